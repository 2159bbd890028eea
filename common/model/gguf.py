"""GGUF checkpoints (llama.cpp's format): tensors read and dequantized by the `gguf` library,
named as the Hugging Face parameters they hold.

The config and tokenizer come from the file's metadata through transformers (see
`Checkpoint`); this module only reads weights. llama.cpp's converter stores llama q/k rows
interleaved for its rotary layout; they are put back in HF's order here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

# gguf's architecture name -> the MODEL_ARCH name of its tensor map. llama.cpp writes Llama and
# Mistral checkpoints as "llama".
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
# Architectures whose q/k weights llama.cpp's converter permuted.
_PERMUTED = ("llama",)
# Tensors llama.cpp stores that hold no parameter of ours (rope factors come from the config).
_IGNORED = ("rope_freqs.weight",)


def _reader(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


def architecture_of(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("GGUF file names no general.architecture")
    return str(field.contents())


def check_architecture(path: Path, reader=None) -> str:
    """The file's architecture; ValueError naming it when pdserve cannot run it. Pass the
    file's reader when one is open: building one parses all the metadata (seconds for a
    tokenizer of 50k tokens)."""
    arch = architecture_of(reader or _reader(path))
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in HF orientation; ValueError naming an unsupported type."""
    from gguf import quants

    qtype = tensor.tensor_type
    try:
        out = quants.dequantize(np.asarray(tensor.data), qtype)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name}: unsupported GGUF quantization type {qtype.name}"
        ) from None
    # GGUF lists dimensions fastest first; HF (and numpy) slowest first.
    return out.reshape(tuple(int(d) for d in reversed(tensor.shape))).astype(np.float32)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (2, d/2) were stored as (d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of unpermute_rotary); for tests."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensors(
    path: Path, hf_names: Iterable[str], num_layers: int, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor of the file. hf_names are the parameters the
    model may hold; a tensor that maps to none of them keeps its GGUF name, so the loader's
    name check reports it as unexpected."""
    import gguf

    reader = _reader(path)
    arch = check_architecture(path, reader)
    name_map = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[SUPPORTED_GGUF_ARCHITECTURES[arch]], num_layers
    )
    to_hf = {}
    for hf_name in hf_names:
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            to_hf[gguf_name] = hf_name
    for tensor in reader.tensors:
        if tensor.name in _IGNORED:
            continue
        name = to_hf.get(tensor.name, tensor.name)
        w = dequantize(tensor)
        if arch in _PERMUTED and name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rotary(w, num_heads)
        elif arch in _PERMUTED and name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rotary(w, num_kv_heads)
        yield name, w

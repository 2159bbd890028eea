"""GGUF checkpoints (llama.cpp's format): tensors read and dequantized by the `gguf` library,
named as the Hugging Face parameters they hold.

The config and tokenizer come from the file's metadata through transformers (see
`Checkpoint`); this module only reads weights. llama.cpp's converter stores llama q/k rows
interleaved for its rotary layout; they are put back in HF's order here.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, slots=True)
class RawTensor:
    """A GGUF tensor as the file stores it: `blocks` is uint8 [out rows, bytes per row] (a
    view of the memory-mapped file unless its rows had to be reordered), `shape` the HF
    orientation [out, in] of the values those bytes encode."""

    name: str  # the HF parameter name (or the GGUF name when it maps to none)
    qtype_name: str  # gguf's GGMLQuantizationType name: "Q4_K", "F32", ...
    blocks: np.ndarray
    shape: tuple[int, ...]


def _named_tensors(
    path: Path, hf_names: Iterable[str], num_layers: int
) -> Iterator[tuple[str, str, object]]:
    """(architecture, HF name, gguf tensor) for every tensor of the file we read; a tensor that
    maps to no HF name keeps its GGUF name, so the loader's name check reports it."""
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
        if tensor.name not in _IGNORED:
            yield arch, to_hf.get(tensor.name, tensor.name), tensor


def _rotary_heads(arch: str, name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads llama.cpp's converter permuted this tensor's rows by (None: not)."""
    if arch in _PERMUTED and name.endswith("self_attn.q_proj.weight"):
        return num_heads
    if arch in _PERMUTED and name.endswith("self_attn.k_proj.weight"):
        return num_kv_heads
    return None


def read_tensors(
    path: Path, hf_names: Iterable[str], num_layers: int, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor of the file. hf_names are the parameters the
    model may hold; a tensor that maps to none of them keeps its GGUF name, so the loader's
    name check reports it as unexpected."""
    for arch, name, tensor in _named_tensors(path, hf_names, num_layers):
        w = dequantize(tensor)
        heads = _rotary_heads(arch, name, num_heads, num_kv_heads)
        yield name, w if heads is None else unpermute_rotary(w, heads)


def read_raw_tensors(
    path: Path, hf_names: Iterable[str], num_layers: int, num_heads: int, num_kv_heads: int
) -> Iterator[RawTensor]:
    """Every tensor of the file as `read_tensors` names it, still quantized. llama.cpp's q/k
    row permutation is undone on the stored rows: a row is whole blocks, so moving rows moves
    blocks and leaves them as they are."""
    for arch, name, tensor in _named_tensors(path, hf_names, num_layers):
        shape = tuple(int(d) for d in reversed(tensor.shape))
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1)
        heads = _rotary_heads(arch, name, num_heads, num_kv_heads)
        if heads is not None:
            blocks = unpermute_rotary(blocks, heads)
        yield RawTensor(name, tensor.tensor_type.name, blocks, shape)

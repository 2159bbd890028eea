"""GGUF checkpoints (llama.cpp's format): tensors read and dequantized by the `gguf` library,
named as the Hugging Face parameters they hold, or read as their quantized blocks and decoded
a chunk of rows at a time by gguf_types.py (quant.py keeps them quantized).

The config and tokenizer come from the file's metadata through transformers (see
`Checkpoint`); this module only reads weights. llama.cpp's converter stores llama q/k rows
interleaved for its rotary layout; they are put back in HF's order here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np

from pdserve.common.model.gguf_index import tensor_index
from pdserve.common.model.gguf_types import QUANTIZED_TYPES, RawTensor, float_rows

# gguf's architecture name -> the MODEL_ARCH name of its tensor map. llama.cpp writes Llama,
# Mistral and Mixtral (with expert tensors) checkpoints as "llama".
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "qwen3moe": "QWEN3MOE",
}
# Architectures the gguf library maps but pdserve cannot load, and why.
_BLOCKED = {
    "deepseek2": "transformers' GGUF reader builds no config from its metadata "
    "(DeepSeek-V3 loads from its HF checkpoint directory)",
}
# Architectures whose q/k weights llama.cpp's converter permuted.
_PERMUTED = ("llama",)
# Tensors llama.cpp stores that hold no parameter of ours (rope factors come from the config).
_IGNORED = ("rope_freqs.weight",)


def open_reader(path: Path):
    """The file's gguf reader (parses all its metadata: open it once)."""
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
    return supported_architecture(path, architecture_of(reader or open_reader(path)))


def supported_architecture(path: Path, arch: str | None) -> str:
    """`arch`, the architecture `path` names, if pdserve runs it; else ValueError."""
    if arch is None:
        raise ValueError("GGUF file names no general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        why = f" ({_BLOCKED[arch]})" if arch in _BLOCKED else ""
        raise ValueError(
            f"{path.name}: unsupported GGUF architecture {arch!r}{why}; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def config_fields(reader) -> tuple[str | None, dict]:
    """(model_type to build instead, or None; config fields to set) for what transformers'
    GGUF reader leaves out of a mixture-of-experts file's config: a "llama" file with experts
    is Mixtral; a Qwen3-MoE file's expert width is a key of its own. (The gguf library's
    qwen3moe tensors have no dense MLP: every layer of such a file is sparse, transformers'
    default.)"""
    arch = architecture_of(reader)
    experts = _field(reader, f"{arch}.expert_count")
    if arch == "llama" and experts:
        used = _field(reader, "llama.expert_used_count")
        return "mixtral", {"num_local_experts": experts, "num_experts_per_tok": used}
    width = _field(reader, f"{arch}.expert_feed_forward_length")
    if arch == "qwen3moe" and width is not None:
        return None, {"moe_intermediate_size": width}
    return None, {}


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


# Our stacked experts' gate_up_proj [E, 2I, H] is two GGUF tensors, ffn_gate_exps and
# ffn_up_exps [E, I, H]: each is named as its half here, and `_joined_experts` joins them.
_GATE_UP = ".experts.gate_up_proj"
_HALVES = ("gate_proj", "up_proj")
_T = TypeVar("_T")


def _gguf_names(name_map, hf_name: str) -> Iterator[tuple[str, str]]:
    """(GGUF name, name read as) of the tensors that hold an HF parameter."""
    if hf_name.endswith(_GATE_UP):
        prefix = hf_name.removesuffix(".gate_up_proj")
        for half in _HALVES:
            gguf_name = name_map.get_name(f"{prefix}.{half}")
            if gguf_name is not None:
                yield f"{gguf_name}.weight", f"{prefix}.{half}"
        return
    gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is not None:
        # A stacked expert parameter has no .weight suffix; its GGUF tensor has.
        suffix = "" if gguf_name.endswith((".weight", ".bias")) else ".weight"
        yield gguf_name + suffix, hf_name


def _named_tensors(
    path: Path, hf_names: Iterable[str], num_layers: int
) -> Iterator[tuple[str, str, object]]:
    """(architecture, HF name, gguf tensor) for every tensor of the file we read; a tensor that
    maps to no HF name keeps its GGUF name, so the loader's name check reports it."""
    reader = open_reader(path)
    arch = check_architecture(path, reader)
    to_hf = _to_hf_names(arch, hf_names, num_layers)
    for tensor in reader.tensors:
        if tensor.name not in _IGNORED:
            yield arch, to_hf.get(tensor.name, tensor.name), tensor


def _to_hf_names(arch: str, hf_names: Iterable[str], num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> the HF name it is read as, for the parameters `hf_names`."""
    import gguf

    name_map = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[SUPPORTED_GGUF_ARCHITECTURES[arch]], num_layers
    )
    return {g: h for hf_name in hf_names for g, h in _gguf_names(name_map, hf_name)}


def _half_of(name: str) -> tuple[str, int] | None:
    """(the gate_up_proj it is half of, 0 gate or 1 up) for an expert half's name."""
    prefix, _, half = name.rpartition(".")
    if prefix.endswith(".experts") and half in _HALVES:
        return prefix + ".gate_up_proj", _HALVES.index(half)
    return None


def _joined_experts(tensors: Iterable[tuple[str, _T]]) -> Iterator[tuple[str, _T]]:
    """Every (name, array), expert gate and up halves joined into gate_up_proj (each
    expert's gate rows, then its up rows) once both of a layer have come; a half whose
    partner never comes keeps its own name, so the loader names it as unexpected."""
    waiting: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors:
        half = _half_of(name)
        if half is None:
            yield name, array
            continue
        parts = waiting.setdefault(half[0], {})
        parts[half[1]] = array
        if len(parts) == 2:
            del waiting[half[0]]
            yield half[0], np.concatenate([parts[0], parts[1]], axis=1)
    for joined, parts in waiting.items():
        for index, array in parts.items():
            yield joined.removesuffix("gate_up_proj") + _HALVES[index], array


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

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        for arch, name, tensor in _named_tensors(path, hf_names, num_layers):
            w = dequantize(tensor)
            heads = _rotary_heads(arch, name, num_heads, num_kv_heads)
            yield name, w if heads is None else unpermute_rotary(w, heads)

    return _joined_experts(arrays())


def read_raw_tensors(
    path: Path, hf_names: Iterable[str], num_layers: int, num_heads: int, num_kv_heads: int
) -> Iterator[RawTensor]:
    """Every tensor of the file as `read_tensors` names it, still quantized. llama.cpp's q/k
    row permutation is undone on the stored rows: a row is whole blocks, so moving rows moves
    blocks and leaves them as they are. Each tensor's bytes are read from the file into memory
    of its own rather than viewed in a map of the file: pages of a mapped file stay resident
    once touched, so a map read through would add the whole file to the loader's peak.
    Stacked experts (3-D) come dequantized, as F32: their gate and up halves are joined."""
    for name, data in _joined_experts(
        _raw_or_experts(path, hf_names, num_layers, num_heads, num_kv_heads)
    ):
        yield data if isinstance(data, RawTensor) else _float_raw(name, data)


def _raw_or_experts(
    path: Path, hf_names: Iterable[str], num_layers: int, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, RawTensor | np.ndarray]]:
    """`read_raw_tensors`' tensors before the expert halves are joined: stacked experts as
    float32 arrays, every other tensor as its blocks. Where each tensor lies comes from the
    file's header alone (`gguf_index`): gguf's reader parses all the metadata into numpy
    arrays first, which for SmolLM2's 49k-token vocabulary was the load's whole peak."""
    arch, infos = tensor_index(path)
    arch = supported_architecture(path, arch)
    to_hf = _to_hf_names(arch, hf_names, num_layers)
    with path.open("rb") as f:
        for info in infos:
            if info.name in _IGNORED:
                continue
            name, qtype_name = to_hf.get(info.name, info.name), info.qtype_name
            shape = info.shape[::-1]  # GGUF lists dimensions fastest first
            f.seek(info.offset)
            blocks = np.fromfile(f, dtype=np.uint8, count=info.n_bytes)
            blocks = blocks.reshape(int(np.prod(shape[:-1])), -1)  # 1 row for a vector
            heads = _rotary_heads(arch, name, num_heads, num_kv_heads)
            if heads is not None:
                blocks = unpermute_rotary(blocks, heads)
            raw = RawTensor(name, qtype_name, blocks, shape)
            yield name, raw if len(shape) < 3 else dequantize_raw(raw)


def _float_raw(name: str, array: np.ndarray) -> RawTensor:
    """A float32 array as an F32 RawTensor."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    rows = int(np.prod(array.shape[:-1]))
    return RawTensor(name, "F32", array.view(np.uint8).reshape(rows, -1), array.shape)


def dequantize_raw(raw: RawTensor) -> np.ndarray:
    """A raw tensor as float32 in its HF shape: a quantized matrix a chunk of rows at a time
    (`float_rows`) (a test holds them to gguf's own decoding), any other (F32, F16, BF16, norms
    and embeddings) by the `gguf` library."""
    if raw.qtype_name in QUANTIZED_TYPES and len(raw.shape) == 2:
        return np.concatenate([w for _, w in float_rows(raw, 1024)])
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[raw.qtype_name]
    try:
        out = quants.dequantize(raw.blocks, qtype)
    except NotImplementedError:
        raise ValueError(
            f"tensor {raw.name}: unsupported GGUF quantization type {raw.qtype_name}"
        ) from None
    return out.reshape(raw.shape).astype(np.float32)

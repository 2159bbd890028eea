"""Load a Llama-family checkpoint (a local Hugging Face directory, or a GGUF file) into our
model.

The model is built on the meta device (no random init, no double memory), then every
parameter is assigned from the checkpoint by name; anything missing, unexpected or misshapen
is a ValueError that names it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.gguf import RawTensor, dequantize_raw, float_rows
from pdserve.common.model.parallel import TPGroup
from pdserve.common.model.quant import (
    Bits,
    QuantizedEmbedding,
    QuantizedLinear,
    from_gguf_blocks,
    gguf_bits,
    gguf_weight,
    quantize_int4,
    quantize_int8,
    quantized_head,
    release_freed_heap,
)
from pdserve.common.model.registry import checkpoint_tensors, model_class
from pdserve.kernels import cpu_quant

# Checkpoint keys that hold no weights of ours: old Llama checkpoints saved rope buffers.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# How many names an error message lists before it says "and N more".
_MAX_NAMES_IN_ERROR = 10


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    dummy_seed: int | None = None,
    tp: TPGroup | None = None,
    quantization: str = "none",
) -> tuple[torch.nn.Module, ModelArchConfig]:
    """Build the model described by model_dir/config.json and load its weights.

    Reads *.safetensors (one file, or shards listed in model.safetensors.index.json); only when
    there are none, pytorch_model.bin (or its shards) through torch.load(weights_only=True).
    With `dummy_seed`, reads no weights: random ones are made on `device` from that seed.
    With `tp`, the model holds this rank's shard of every weight (see `parallel.TPShard`).
    `quantization` ("auto", "none", "int8", "int4"; see `linear_bits`) puts a `QuantizedLinear`
    in place of each decoder linear it quantizes; a GGUF is then read one tensor at a time,
    each converted before the next is read.
    Returns the model in eval mode with gradients off, on `device`, in `dtype`.
    """
    config = ModelArchConfig.from_dir(model_dir)
    if tp is not None:
        tp.shard.check(config)
    mode = _effective_quantization(quantization, torch.device(device), dtype)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, tp)
        full = cls(config) if tp is not None else model
    expected = {name: p.shape for name, p in model.named_parameters()}
    shapes = {name: p.shape for name, p in full.named_parameters()}
    if dummy_seed is not None:
        tensors = _random_state(shapes, dtype, torch.device(device), dummy_seed).items()
    else:
        checkpoint = Checkpoint.resolve(model_dir)
        tensors = checkpoint_tensors(
            config, _iter_checkpoint(checkpoint, config, expected, mode != "none")
        )
    state, layers, loaded = {}, {}, {}
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    for name, data in tensors:
        if _ignored(name, config):
            continue
        if _quantized_vocab(mode, name, data, tp, dtype) and shapes[name] == _shape(data):
            layers[name] = _vocab_layer(name, data, dtype)
            loaded[name] = shapes[name]
            continue
        bits = linear_bits(mode, name, data) if name in expected else None
        if bits is not None and shapes[name] == _shape(data):
            layers[name] = _quantized_linear(name, data, bits, tp, config, scale_dtype)
            loaded[name] = torch.Size((layers[name].out_features, layers[name].in_features))
            continue
        tensor = _as_tensor(data, dtype)
        if tp is not None and shapes.get(name) == tensor.shape:  # else named as misshapen
            tensor = tp.shard.shard(name, tensor, config)
        state[name] = tensor.to(device=device, dtype=dtype)
        loaded[name] = state[name].shape
    _check_names(expected, loaded, model_dir)
    _install(model, layers, state)
    if layers:
        tensors = None  # the GGUF reader and its parsed metadata go with it
        release_freed_heap()
    # Buffers (rope inv_freq) stay float32: HF computes rope in float32 whatever the dtype.
    model.to(device)
    model.requires_grad_(False)
    return model.eval(), config


# The decoder's linear layers, by the module names HF gives them: the only linears quantized
# (norms stay float in the engine's dtype; the embedding and an untied LM head stay quantized
# where `_quantized_vocab` says so, float otherwise).
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _effective_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """`mode` where it runs. Quantized linears are CPU kernels, so `auto` elsewhere is none;
    and `auto` in a float32 engine is none too unless the AVX2 GEMV (kernels/cpu_quant.py)
    runs here: torch's packed kernels are slow on float32 activations (SmolLM2 int4: 130 ms a
    decode token against 61 ms dequantized), ours not (docs/quantization.md, "float32
    engines at the file's bits"). `int8`/`int4` are taken as asked."""
    if mode not in ("auto", "none", "int8", "int4"):
        raise ValueError(f"quantization must be auto, none, int8 or int4, not {mode!r}")
    slow_f32 = dtype == torch.float32 and not cpu_quant.available()
    if mode == "auto" and (device.type != "cpu" or slow_f32):
        return "none"
    if device.type == "cpu" or mode in ("auto", "none"):
        return mode
    raise ValueError(f"quantization {mode} runs on the CPU only, not on {device}")


def linear_bits(mode: str, name: str, data: torch.Tensor | RawTensor) -> Bits | None:
    """The width a checkpoint tensor is held at (None: float, as the engine's dtype): int8 or
    int4 for every decoder linear weight under those modes; under `auto`, a GGUF quantized
    type's own choice (`gguf_bits`), float for anything stored as float."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if not name.endswith(".weight") or module not in QUANTIZED_MODULES or mode == "none":
        return None
    if mode == "int8":
        return 8
    if mode == "int4":
        return 4
    return gguf_bits(data.qtype_name) if isinstance(data, RawTensor) else None


_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _quantized_vocab(
    mode: str, name: str, data: torch.Tensor | RawTensor, tp: TPGroup | None, dtype: torch.dtype
) -> bool:
    """Whether the embedding or an untied LM head stays quantized: under `auto`, one the GGUF
    stores in any quantized type, on one rank (sharded ones stay float), in a bf16/fp16
    engine. A float32 engine keeps them float at every TP size: its nodes then hold one weight
    form whatever their TP size, so a TP 3 prefill node pairs with a TP 1 decode node (the
    layout names the form; with the vocabulary int8 at TP 1 only, they never paired: the
    reverted 73d89de's prefill node "not ready"). bf16 engines still differ so."""
    return (
        mode == "auto"
        and name in _VOCAB
        and tp is None
        and dtype != torch.float32
        and isinstance(data, RawTensor)
        and gguf_bits(data.qtype_name) is not None
    )


def _vocab_layer(
    name: str, data: RawTensor, dtype: torch.dtype
) -> QuantizedEmbedding | QuantizedLinear:
    """The embedding held int8 per row, or int5 at a Q5 type's bits (a lookup reads rows,
    which int4's packing does not give back cheaply; an int4 type is requantized); the head at
    its type's width, int8 where int4 cannot hold it (a vocabulary not a multiple of 16)."""
    if name != "lm_head.weight":
        bits = 5 if gguf_bits(data.qtype_name) == 5 else 8
        return QuantizedEmbedding(gguf_weight(data, bits), dtype)
    try:
        return quantized_head(gguf_weight(data), dtype)
    except ValueError:
        return quantized_head(from_gguf_blocks(data, 8), dtype)


def _shape(data: torch.Tensor | RawTensor) -> torch.Size:
    return torch.Size(data.shape)


def _as_tensor(data: torch.Tensor | RawTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float tensor; a quantized GGUF matrix (an embedding) decoded a chunk of rows at a time
    straight into `dtype`: whole, gguf's own dequantization held several float32 copies of
    SmolLM2's 49152-row embedding at once, the load's largest transient."""
    if not isinstance(data, RawTensor):
        return data
    if gguf_bits(data.qtype_name) is None or len(data.shape) != 2:
        return torch.from_numpy(dequantize_raw(data))
    out = torch.empty(data.shape, dtype=dtype)
    for start, rows in float_rows(data, 1024):
        out[start : start + len(rows)] = torch.from_numpy(rows)
    return out


def _quantized_linear(
    name: str,
    data: torch.Tensor | RawTensor,
    bits: Bits,
    tp: TPGroup | None,
    config: ModelArchConfig,
    scale_dtype: torch.dtype,
) -> QuantizedLinear:
    """A linear weight as this rank holds it quantized (its bias is set once all are read).
    GGUF blocks convert first and the rank slices the integers; a float weight is sliced
    first, so each rank's int8 rows get their own scales."""
    try:
        if isinstance(data, RawTensor) and gguf_bits(data.qtype_name) is not None and tp is None:
            weight = gguf_weight(data, bits)
        elif isinstance(data, RawTensor) and gguf_bits(data.qtype_name) is not None:
            weight = tp.shard.shard_quantized(name, from_gguf_blocks(data, bits), config)
        else:
            tensor = _as_tensor(data)
            if tp is not None:
                tensor = tp.shard.shard(name, tensor, config)
            weight = quantize_int8(tensor) if bits == 8 else quantize_int4(tensor)
        return QuantizedLinear(weight, None, scale_dtype=scale_dtype)
    except ValueError as exc:
        raise ValueError(
            f"{name} cannot be held as int{bits}: {exc} (try --quantization int8 or none)"
        ) from exc


def _install(
    model: torch.nn.Module,
    layers: dict[str, QuantizedLinear | QuantizedEmbedding],
    state: dict[str, torch.Tensor],
) -> None:
    """Quantized layers in place of their meta modules (a linear takes its bias from `state`),
    then every other tensor assigned by name. The names were checked against the model's
    before, so the quantized modules' buffers are the only keys load_state_dict lacks."""
    for name, layer in layers.items():
        module = name.removesuffix(".weight")
        bias = state.pop(f"{module}.bias", None)
        if bias is not None:
            layer.bias = bias
        model.set_submodule(module, layer)
    model.load_state_dict(state, strict=not layers, assign=True)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    assert not left, f"weights not loaded: {_names(left)}"


def _random_state(
    shapes: dict[str, torch.Size], dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Weights of the given shapes: norms 1, everything else N(0, 0.02) as HF initialises."""
    gen = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            state[name] = t.normal_(0.0, 0.02, generator=gen)
    return state


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of model_dir, safetensors preferred; ValueError when there are none."""
    for index_name, single_name, pattern in (
        ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin"),
    ):
        index = model_dir / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [model_dir / f for f in sorted(set(weight_map.values()))]
        # Without an index, the standard single-file name wins over stray files such as
        # Mistral's consolidated.safetensors (the same weights under other names).
        single = model_dir / single_name
        if single.is_file():
            return [single]
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise ValueError(f"no *.safetensors or pytorch_model.bin weights in {model_dir}")


def _iter_checkpoint(
    checkpoint: Checkpoint, config: ModelArchConfig, expected: dict[str, torch.Size], raw: bool
) -> Iterator[tuple[str, torch.Tensor | RawTensor]]:
    """(name, tensor) one at a time; with `raw`, a GGUF's tensors come still quantized."""
    if checkpoint.is_gguf:
        from pdserve.common.model.gguf import read_raw_tensors, read_tensors

        names = [*expected, "lm_head.weight"]  # a tied model's file may still hold lm_head
        args = (checkpoint.gguf_path, names, config.num_layers, config.num_heads)
        if raw:
            for tensor in read_raw_tensors(*args, config.num_kv_heads):
                yield tensor.name, tensor
            return
        for name, array in read_tensors(*args, config.num_kv_heads):
            yield name, torch.from_numpy(array)
        return
    from safetensors import safe_open

    for path in checkpoint_files(checkpoint.directory):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            # weights_only refuses arbitrary pickled objects: a checkpoint is data, not code.
            yield from torch.load(path, map_location="cpu", weights_only=True).items()


def _ignored(name: str, config: ModelArchConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # Some tied checkpoints still store a copy of the embedding as lm_head; HF ignores it too.
    return config.tie_word_embeddings and name == "lm_head.weight"


def _check_names(
    expected: dict[str, torch.Size], loaded: dict[str, torch.Size], model_dir: Path
) -> None:
    missing = sorted(expected.keys() - loaded.keys())
    unexpected = sorted(loaded.keys() - expected.keys())
    misshapen = sorted(
        f"{n} {tuple(loaded[n])} != {tuple(s)}"
        for n, s in expected.items()
        if n in loaded and loaded[n] != s
    )
    problems = [
        f"{what} ({len(names)}): {_names(names)}"
        for what, names in (
            ("missing weights", missing),
            ("unexpected weights", unexpected),
            ("wrong shapes", misshapen),
        )
        if names
    ]
    if problems:
        raise ValueError(f"checkpoint {model_dir} does not match the model: " + "; ".join(problems))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return f"{shown} and {more} more" if more > 0 else shown


def model_fingerprint(model_dir: str | Path) -> str:
    """A short id of a checkpoint: its config plus a sample of every weight file.

    Two nodes must hold the same model for their KV to be interchangeable; this tells apart
    checkpoints with equal shapes but other weights, without hashing gigabytes.
    """
    checkpoint = Checkpoint.resolve(model_dir)
    if checkpoint.is_gguf:  # the metadata (config, tokenizer) sits in the file itself
        h, files = hashlib.sha256(b"gguf"), [checkpoint.gguf_path]
    else:
        h = hashlib.sha256((checkpoint.directory / "config.json").read_bytes())
        files = checkpoint_files(checkpoint.directory)
    sample = 1 << 16
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(sample))
            f.seek(max(0, size - sample))
            h.update(f.read(sample))
    return h.hexdigest()[:16]

"""A self-draft for `draft_model`: a checkpoint cut to its first layers, with its embedding,
final norm and LM head kept (an early exit). It shares the target's tokenizer and page
geometry by construction, so one checkpoint gives a draft with real acceptance: how the tests
and `pdserve bench spec` get one. A GGUF target is read (dequantized) through the loader and
written as safetensors in `dtype`; a safetensors directory is cut as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.config import ModelArchConfig


def _kept(name: str, layers: int) -> bool:
    """Whether a weight belongs to the draft: every one but decoder layers >= `layers`."""
    return not name.startswith("model.layers.") or int(name.split(".")[2]) < layers


def _float_weights(target: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The target's weights by HF name, float, as the loader builds them (GGUF dequantized)."""
    from safetensors.torch import load_file

    from pdserve.common.model.weights import checkpoint_files, load_model

    if not target.is_gguf:
        files = checkpoint_files(target.directory)
        return {k: v.to(dtype) for f in files for k, v in load_file(f).items()}
    model, _ = load_model(target.gguf_path, torch.float32, "cpu")
    return {name: p.detach().to(dtype).clone() for name, p in model.named_parameters()}


def write_self_draft(
    target: str | Path, layers: int, out: Path, dtype: torch.dtype = torch.float32
) -> Path:
    """The checkpoint at `target` (a directory or a GGUF file) cut to its first `layers`
    decoder layers, written to `out` (config, tokenizer files and model.safetensors);
    ValueError when `layers` is not in [1, the target's layers]."""
    from safetensors.torch import save_file

    checkpoint = Checkpoint.resolve(target)
    source = checkpoint.hf_dir()
    total = ModelArchConfig.from_dir(source).num_layers
    if not 1 <= layers <= total:
        raise ValueError(f"a self-draft takes 1 to {total} layers of {target}, not {layers}")
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if (
            f.is_file()
            and f.suffix not in (".safetensors", ".bin", ".gguf")
            and f.name != ("model.safetensors.index.json")
        ):
            shutil.copy(f, out / f.name)
    weights = _float_weights(checkpoint, dtype)
    kept = {name: w.contiguous() for name, w in weights.items() if _kept(name, layers)}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

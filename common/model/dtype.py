"""`--dtype auto`: the dtype an engine runs in, chosen once from the checkpoint and the machine.

Torch is imported only by the CPU probe, and only when `auto` is resolved on a CPU.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pdserve.common.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")

# The CPU flags (Linux /proc/cpuinfo) of native bf16 arithmetic: AVX512-BF16's dot products
# and AMX's bf16 tiles. Without either, torch emulates bf16 by converting to float32 and back,
# slower than float32 itself.
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype the checkpoint's weights are stored in: config.json's `torch_dtype` (or
    `dtype`, transformers 5's name); bf16 for a GGUF (a quantized file has no float dtype of
    its own, and llama.cpp computes in it). None when it cannot be read or names none."""
    try:
        checkpoint = Checkpoint.resolve(model_dir)
    except ValueError:
        return None  # the loader reports a missing checkpoint with its own message
    if checkpoint.is_gguf:
        return "bfloat16"
    try:
        config = json.loads((checkpoint.directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    stored = config.get("torch_dtype") or config.get("dtype")
    return stored if stored in DTYPES else None


def cpu_bf16_flag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU flag that makes bf16 fast here ("amx_bf16" or "avx512_bf16"), or None.

    Both the flag and torch's own dispatch must agree: torch.backends.cpu.get_cpu_capability()
    names the vector ISA its kernels were chosen for ("AVX512", "AVX2", ...) but not whether
    the CPU has the bf16 instructions, and /proc/cpuinfo names those but not whether torch
    uses its AVX512 kernels (ATEN_CPU_CAPABILITY can lower it). Without /proc/cpuinfo (not
    Linux) the answer is None: float32 is never the slow choice."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    found = next((f for f in _BF16_FLAGS if f in flags), None)
    return found if found and "AVX512" in _torch_cpu_capability() else None


def _torch_cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def choose_dtype(stored: str | None, device: str, cpu_bf16: bool) -> str:
    """The decision itself. On CUDA the checkpoint's half type (bf16 for a float32 or bf16
    checkpoint, fp16 for an fp16 one); on a CPU bf16 when it has native bf16 whatever the
    checkpoint holds (torch's CPU fp16 matmuls are slower than bf16's), float32 otherwise."""
    if device.startswith("cuda"):
        return "float16" if stored == "float16" else "bfloat16"
    return "bfloat16" if cpu_bf16 else "float32"


def resolve_auto(model_dir: str, device: str) -> str:
    """`auto` made concrete for this checkpoint on this device, and logged."""
    stored = checkpoint_dtype(model_dir)
    flag = None if device.startswith("cuda") else cpu_bf16_flag()
    chosen = choose_dtype(stored, device, flag is not None)
    why = "cuda" if device.startswith("cuda") else f"cpu {flag or 'without native bf16'}"
    log.info("dtype auto: %s (checkpoint %s, %s)", chosen, stored or "unnamed", why)
    return chosen

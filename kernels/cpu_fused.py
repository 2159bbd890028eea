"""Fused elementwise kernels for a bf16 engine's eager CPU steps (kernels/cpu_fused.cpp).

An eager bf16 prefill step spends about a fifth of its CPU time beside the quantized GEMMs in
aten's elementwise ops (docs/quantization.md's profile): RMSNorm's cast, pow, mean, rsqrt and
two muls, rope's cat, slices, neg and muls, SwiGLU's silu and mul, each a pass over [T, n]
with its own dispatch and output. Here each is one pass a row, with the eager code's roundings:

- `rms_norm`: float32 mean of squares, r = rsqrt(mean + eps), y = bf16(x r), out =
  bf16(weight y). Equal to the eager code except where the float32 sum's order (16 lanes, then
  a reduce) moves the mean by an ulp and that moves a bf16 rounding (tests/kernels/
  test_cpu_fused.py bounds how often).
- `add_rms_norm`: (s = bf16(x + delta), rms_norm(s)): a residual add and the norm it feeds.
- `silu_mul`: bf16(bf16(silu(g)) u), silu(g) = g / (1 + exp(-g)) in float32 with a polynomial
  exp (~1e-7 relative, as torch's Sleef one; a rare bf16 rounding differs).
- `rope`: bf16(bf16(x cos) + bf16(rot(x) sin)), rot(x) = (-x[D/2:], x[:D/2]): each step one
  correctly rounded bf16 op, so bit-equal to the eager code.

Used only where `serves` says: bf16 CPU tensors in an eager forward (never under
torch.compile or torch.export, so compiled packages trace the torch code as before; float32
engines, whose greedy output equals HF's, never get here). AVX512 where /proc/cpuinfo shows
AVX512F/BW/VL/DQ, a plain loop otherwise. Built like cpu_attention's kernel; where it does not
build, `available()` is False (logged once) and the torch code runs.
$PDSERVE_CPU_FUSED: "auto" (default) or "off" (the torch code), read at each call.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from pdserve.kernels import cpu_quant
from pdserve.kernels.cpu_attention import cpu_has_avx512

log = logging.getLogger(__name__)

FUSED_KERNEL_ENV = "PDSERVE_CPU_FUSED"
_MODES = ("auto", "off")
_SOURCE = cpu_quant.kernel_source("cpu_fused.cpp")
_FUNCTIONS = ["rms_norm", "add_rms_norm", "silu_mul", "rope"]


@cache
def _module():  # noqa: ANN202 (a compiled extension module)
    # contraction off: x * r then + would otherwise fuse into one rounding the eager ops lack
    return cpu_quant.load_extension("cpu_fused", _SOURCE, _FUNCTIONS, ["-ffp-contract=off"])


def _mode() -> str:
    return cpu_quant.env_mode(FUSED_KERNEL_ENV, _MODES)


@cache
def available() -> bool:
    """Whether the source compiled (once per process); logs why not, once."""
    return cpu_quant.builds(_module, "cpu fused kernels", "torch's ops")


@cache
def _avx512() -> bool:
    return cpu_has_avx512()


def serves(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the fused kernels: all bf16 on the CPU, an eager call (not
    traced by torch.compile or torch.export), $PDSERVE_CPU_FUSED not off, the source built."""
    # a plain loop, not any(): this runs a few times a layer, and a 1-row step is microseconds
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    for t in tensors:
        if t.dtype != torch.bfloat16 or t.device.type != "cpu":
            return False
    return _mode() == "auto" and available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, n] rows (itself, or a view where its rows are contiguous, else a copy)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _shaped(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y if like.dim() == 2 else y.view(like.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] by weight [H], both bf16 -> x's shape, bf16."""
    return _shaped(_module().rms_norm(_rows(x), weight, eps, _avx512()), x)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16(x + delta), its RMSNorm) for x, delta [..., H] and weight [H], all bf16."""
    s, y = _module().add_rms_norm(_rows(x), _rows(delta), weight, eps, _avx512())
    return _shaped(s, x), _shaped(y, x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up) for gate, up [..., I] bf16 (a fused gate_up's halves may
    be passed as they are: rows need only be contiguous within)."""
    return _shaped(_module().silu_mul(_rows(gate), _rows(up), _avx512()), gate)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token cos, sin [T, D] (rotate-half), bf16 -> contiguous
    [T, H, D]; x's tokens may lie apart (q or k split off a fused qkv output)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return _module().rope(x, cos.contiguous(), sin.contiguous(), _avx512())

"""The fused bf16 elementwise kernels (kernels/cpu_fused) against the eager torch code they
replace (common/model/llama.py's), on ragged row counts and odd widths, on both paths; and the
model-level switch: a bf16 eager forward takes them, a traced or float32 one does not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from pdserve.common.model import llama
from pdserve.kernels import cpu_fused
from pdserve.kernels.cpu_attention import cpu_has_avx512

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="the kernels did not build")

PATHS = [
    pytest.param(True, id="avx512", marks=pytest.mark.skipif(
        not cpu_has_avx512(), reason="no AVX512 on this CPU")),
    pytest.param(False, id="plain"),
]  # fmt: skip
ROWS = [1, 3, 17, 510]
# rms_norm and silu_mul may differ from the eager ops where a float32 sum's order or exp's last
# bit moves a bf16 rounding, in at most this fraction of the elements (measured: 1.4e-5 of
# rms_norm's on the plain path, none on AVX512's or of silu_mul's; docs/quantization.md). A norm's
# r an ulp off moves bf16(x r) one bf16 ulp, and weight times that can then land two apart.
ULP_FRACTION = 0.002


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.float().mean().item() <= ULP_FRACTION, f"{differ.sum()} of {got.numel()} differ"
    # bf16 ulps: bit patterns apart (same sign)
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert steps.max().item() <= ulps, f"{steps.max()} ulps apart"


def eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = llama.RMSNorm(x.shape[-1], eps).bfloat16()
    norm.weight.data.copy_(weight)
    with mock.patch.object(cpu_fused, "serves", lambda *_: False):
        return norm(x)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 64, 37])
def test_rms_norm_equals_the_eager_norm_but_for_rare_ulps(avx512, rows, width):
    torch.manual_seed(rows + width)
    x = (torch.randn(rows, width) * 3).bfloat16()
    weight = (torch.rand(width) + 0.5).bfloat16()
    got = cpu_fused._module().rms_norm(x, weight, 1e-5, avx512)
    assert_within_ulps(got, eager_norm(x, weight, 1e-5), 2)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 37])
def test_add_rms_norm_is_the_eager_add_then_norm(avx512, rows, width):
    torch.manual_seed(rows * width)
    x, delta = (torch.randn(2, rows, width) * 2).bfloat16()
    weight = (torch.rand(width) + 0.5).bfloat16()
    total, got = cpu_fused._module().add_rms_norm(x, delta, weight, 1e-5, avx512)
    assert torch.equal(total, x + delta)  # one correctly rounded bf16 add
    assert_within_ulps(got, eager_norm(x + delta, weight, 1e-5), 2)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 64, 23])
def test_silu_mul_equals_the_eager_swiglu_but_for_rare_ulps(avx512, rows, width):
    torch.manual_seed(rows + 7 * width)
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)  # the fused projection's halves, rows apart
    got = cpu_fused._module().silu_mul(gate, up, avx512)
    assert_within_ulps(got, F.silu(gate) * up, 1)


def test_silu_mul_at_the_exp_extremes():
    gate = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0] * 3]).bfloat16()
    up = torch.ones_like(gate)
    for avx512 in [False] + [True] * cpu_has_avx512():
        assert torch.equal(cpu_fused._module().silu_mul(gate, up, avx512), F.silu(gate) * up)


@pytest.mark.parametrize("avx512", PATHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "dim"), [(9, 64), (3, 64), (5, 32), (2, 6)])
def test_rope_is_bit_equal_to_apply_rope(avx512, rows, heads, dim):
    torch.manual_seed(rows + heads + dim)
    qkv = (torch.randn(rows, 3 * heads, dim) * 2).bfloat16()
    x = qkv[:, heads : 2 * heads]  # a split-off k: its tokens lie 3 * heads * dim apart
    angles = torch.rand(rows, dim) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = cpu_fused._module().rope(x, cos, sin, avx512)
    assert torch.equal(got, llama.apply_rope(x, cos, sin))


def test_the_wrappers_take_any_leading_shape():
    x = torch.randn(4, 3, 64).bfloat16()
    w = torch.rand(64).bfloat16()
    assert cpu_fused.rms_norm(x, w, 1e-6).shape == (4, 3, 64)
    assert cpu_fused.silu_mul(x, x).shape == (4, 3, 64)


def test_serves_only_eager_bf16_cpu_tensors(monkeypatch):
    b, f = torch.ones(2, 8).bfloat16(), torch.ones(2, 8)
    assert cpu_fused.serves(b, b)
    assert not cpu_fused.serves(b, f)  # a float32 engine's tensors never take them
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not cpu_fused.serves(b)
    monkeypatch.undo()
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert not cpu_fused.serves(b)
    monkeypatch.undo()
    monkeypatch.setenv(cpu_fused.FUSED_KERNEL_ENV, "off")
    assert not cpu_fused.serves(b)
    monkeypatch.setenv(cpu_fused.FUSED_KERNEL_ENV, "sometimes")
    with pytest.raises(ValueError, match="PDSERVE_CPU_FUSED"):
        cpu_fused.serves(b)


def counted(monkeypatch) -> dict[str, int]:
    """Calls of each kernel through the module's wrappers."""
    calls = dict.fromkeys(["rms_norm", "add_rms_norm", "silu_mul", "rope"], 0)
    for name in calls:
        real = getattr(cpu_fused, name)

        def wrapper(*args, _name=name, _real=real):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(cpu_fused, name, wrapper)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_eager_bf16_forward_takes_the_kernels_and_float32_does_not(
    tiny_model_dir: Callable[..., Path], monkeypatch, dtype
):
    from pdserve.common.engine.llm import LLM, SamplingParams

    calls = counted(monkeypatch)
    llm = LLM(str(tiny_model_dir("llama")), dtype=str(dtype).split(".")[1], enforce_eager=True,
              skip_tokenizer_init=True)  # fmt: skip
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    layers = len(llm.engine.runner.model.model.layers)
    if dtype == torch.float32:
        assert set(calls.values()) == {0}
    else:  # per step: 1 norm a layer and the final one, 2 ropes, an add + norm, a silu_mul
        assert calls == {"rms_norm": 2 * (layers + 1), "add_rms_norm": 2 * layers,
                         "silu_mul": 2 * layers, "rope": 4 * layers}  # fmt: skip


def test_a_traced_forward_runs_the_torch_code(monkeypatch):
    calls = counted(monkeypatch)
    norm = llama.RMSNorm(64, 1e-6).bfloat16()
    mlp_in = torch.randn(3, 64).bfloat16()

    def body(x: torch.Tensor) -> torch.Tensor:
        s, h = norm.add_forward(x, x)
        q = llama.rope_qk(h.view(3, 2, 32), h.view(3, 2, 32), h[:, :32], h[:, 32:])[0]
        return llama.silu_mul(q.reshape(3, 64), s)

    graph = torch.export.export(_Wrap(body), (mlp_in,))
    assert set(calls.values()) == {0}
    torch.testing.assert_close(graph.module()(mlp_in), body(mlp_in), atol=0.05, rtol=0.02)
    assert calls["silu_mul"] == 1  # the eager call took the kernels


class _Wrap(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def test_greedy_output_with_and_without_the_kernels(
    tiny_model_dir: Callable[..., Path], monkeypatch
):
    from pdserve.common.engine.llm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", enforce_eager=True,
              skip_tokenizer_init=True)  # fmt: skip
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40)), [9] * 17]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    fused = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv(cpu_fused.FUSED_KERNEL_ENV, "off")
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert fused == plain


def test_threads_split_the_rows_and_change_no_bit():
    """The suite runs one thread; a server runs several, each kernel's rows split among them."""
    torch.manual_seed(1)
    x, d = torch.randn(2, 510, 576).bfloat16()
    w = torch.rand(576).bfloat16()
    g, u = torch.randn(510, 3072).bfloat16().chunk(2, -1)
    q, cos, sin = torch.randn(510, 9, 64).bfloat16(), *torch.rand(2, 510, 64).bfloat16()
    m, threads = cpu_fused._module(), torch.get_num_threads()

    def outputs() -> list[torch.Tensor]:
        avx512 = cpu_has_avx512()
        norms = [m.rms_norm(x, w, 1e-5, avx512), *m.add_rms_norm(x, d, w, 1e-5, False)]
        return [*norms, m.silu_mul(g, u, avx512), m.rope(q, cos, sin, avx512)]

    try:
        torch.set_num_threads(1)
        one = outputs()
        torch.set_num_threads(3)
        assert all(torch.equal(a, b) for a, b in zip(one, outputs(), strict=True))
    finally:
        torch.set_num_threads(threads)

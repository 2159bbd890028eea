"""oneDNN-packed linears (kernels/ops.py) in an engine that compiles its decode steps
(`--compile-mode background`, the CPU default): its eager steps run the packed weights as an
eager engine's do, the plain ones stay under their names for the packages (traced over the plain
model, bound by name at load), and a packed layer traces as nn.Linear over its plain weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.engine.background_compile import BackgroundCompile
from pdserve.common.engine.llm import LLM
from pdserve.common.model.dtype import cpu_bf16_flag
from pdserve.common.model.weights import load_model
from pdserve.kernels.ops import PackedLinear, cpu_linear_enabled, packs
from tests.common.model.test_background_compile import PROMPT, _dying_child
from tests.common.model.test_compile import QWEN2_SLIDING
from tests.common.test_llm_equivalence import GREEDY, PROMPTS
from tests.devices import ON_CUDA

needs_native_bf16 = pytest.mark.skipif(
    ON_CUDA or cpu_bf16_flag() is None or not cpu_linear_enabled(),
    reason="bf16 linears are packed on a CPU with native bf16 (AVX512-BF16 or AMX) only",
)


@needs_native_bf16
def test_a_compiling_bf16_engine_runs_its_eager_steps_packed(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background child exits at once (the bucket stays eager): every decode step runs
    eager, over the packed layers, and gives the eager engine's tokens exactly."""
    model_dir = str(tiny_model_dir("qwen2", **QWEN2_SLIDING))
    monkeypatch.setattr(BackgroundCompile, "command", _dying_child("exit", []))
    common = {"dtype": "bfloat16", "max_num_seqs": 1, "skip_tokenizer_init": True}
    with LLM(model_dir, compile_mode="eager", **common) as eager:
        (want,) = eager.generate([PROMPTS[PROMPT]], GREEDY)
    plain, _ = load_model(model_dir, torch.bfloat16, "cpu")
    cache = str(tmp_path)
    with LLM(model_dir, compile_mode="background", compile_cache_dir=cache, **common) as llm:
        assert llm.engine.runner.compiled.background.wait(60)
        model = llm.engine.runner.model
        layers = [m for layer in model.model.layers for m in layer.modules()]
        assert not any(type(m) is nn.Linear for m in layers)
        assert isinstance(model.lm_head, PackedLinear)  # tied: a packed copy
        # What a package traced over the plain model binds by name (its parameters and
        # buffers: DecodePackage) is all there, unchanged; a packed layer's bias is a buffer.
        held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name, weight in [*plain.named_parameters(), *plain.named_buffers()]:
            assert torch.equal(held[name], weight), name
        (got,) = llm.generate([PROMPTS[PROMPT]], GREEDY)
        assert not llm.engine.runner.compiled.packages
    assert got.token_ids == want.token_ids


@needs_native_bf16
def test_a_packed_layer_traces_as_nn_linear_over_its_plain_weight() -> None:
    weight, bias = torch.randn(48, 32).bfloat16(), torch.randn(48).bfloat16()
    assert packs(weight, native_bf16=True)
    x = torch.randn(3, 32).bfloat16()
    program = torch.export.export(PackedLinear(weight, bias, keep_plain=True), (x,), strict=False)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert targets == {"aten.linear.default"}, targets
    torch.testing.assert_close(program.module()(x), F.linear(x, weight, bias))
    with pytest.raises(AssertionError, match="eager only"):
        torch.export.export(PackedLinear(weight, bias), (x,), strict=False)

"""A GGUF model's decode steps compiled through the GEMV's ops (kernels/cpu_quant.py): its
linears stay at their bits on the GEMV, the background child exports them as
`pdserve::cpu_int{4,5,8}_mm` calls (an AOTInductor package runs them through its proxy
executor), the package binds the model's packed buffers by name, the compiled steps give
eager's greedy tokens (test_background_compile.py: a second start loads the package and
compiles nothing).

One cold compile (bucket 1 of the tiny Llama as a Q4_1 file, float32: the GEMV's exact AVX2
path, so eager's tokens are the oracle), shared with test_background_compile.py: `gguf_switch`
(tests/common/model/conftest.py), whose root is its own."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.compile_cache import compile_key
from pdserve.common.model.quant import QuantizedLinear, gemv_paths
from pdserve.kernels import cpu_quant
from tests.common.model.test_background_compile import (
    SHARES_GGUF_SWITCH,
    Switch,
    tokens,
    waits_for_a_compile,
)
from tests.common.model.test_compile import one_thread  # noqa: F401 (autouse: one thread)
from tests.devices import ON_CUDA

pytest.importorskip("gguf", reason="gguf is a pdserve dependency: install pdserve")

pytestmark = [
    pytest.mark.skipif(
        ON_CUDA or not cpu_quant.available(), reason="the GEMV and its packages are the CPU's"
    ),
    SHARES_GGUF_SWITCH,
]


@waits_for_a_compile
def test_a_gguf_model_compiles_through_the_gemv_with_eager_tokens(
    gguf_switch: Switch, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = gguf_switch.llm
    runner = llm.engine.runner
    gemv = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear) and m.gemv]
    assert gemv and all(m.bits == 4 for m in gemv)  # Q4_1 held at its bits, on the GEMV
    assert gemv_paths(runner.model) == "avx2"  # float32: the exact path
    compiled = runner.compiled
    assert compiled is not None and compiled.background, "a GGUF model was kept eager"
    assert compiled.background.compiled == [1], "the background compile did not finish"
    steps: list[bool] = []
    runs = compiled.runs
    monkeypatch.setattr(compiled, "runs", lambda batch: steps.append(runs(batch)) or steps[-1])
    assert tokens(llm) == gguf_switch.eager_tokens
    assert steps and all(steps), steps  # every decode step ran the package
    # The package reads the model's own packed weights: no copy of them was made.
    (package,) = compiled.packages.values()
    names = package.loader.get_constant_fqns()
    assert "model.model.layers.0.mlp.down_proj.qweight" in names, names[:8]


def test_the_gemv_path_is_part_of_the_compile_key() -> None:
    """A package bakes its layers' path (AVX2's float sums or VNNI's int8 activations) in:
    the key names it, so a package made on one path never serves the other."""
    weight = torch.randn(64, 64)
    layers = [QuantizedLinear.from_float(weight, None, "int8") for _ in range(2)]
    layers[0].vnni, layers[1].vnni = False, True
    assert gemv_paths(torch.nn.Sequential(*layers)) == "avx2+vnni"
    keys = [compile_key(layer, "arch", torch.bfloat16, {}, "code") for layer in layers]
    assert "int8 avx2" in keys[0].model and "int8 vnni" in keys[1].model
    assert keys[0].digest() != keys[1].digest()
    assert gemv_paths(torch.nn.Linear(4, 4)) == ""

"""A GGUF model's decode steps compiled through the GEMV's ops (kernels/cpu_quant.py): its
linears stay at their bits on the GEMV, the background child exports them as
`pdserve::cpu_int{4,5,8}_mm` calls (an AOTInductor package runs them through its proxy
executor), the package binds the model's packed buffers by name, the compiled steps give
eager's greedy tokens, and a second start loads the package and compiles nothing.

One cold compile (bucket 1 of the tiny Llama as a Q4_1 file, float32: the GEMV's exact AVX2
path, so eager's tokens are the oracle); the cache root is the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.engine.compile_cache import compile_key
from pdserve.common.engine.llm import LLM
from pdserve.common.model.quant import QuantizedLinear, gemv_paths
from pdserve.kernels import cpu_quant
from tests.common.model.test_background_compile import COMPILE_WAIT_S, PROMPT, start
from tests.common.model.test_compile import one_thread  # noqa: F401 (autouse: one thread)
from tests.common.test_llm_equivalence import GREEDY, PROMPTS
from tests.devices import ON_CUDA

gguf = pytest.importorskip("gguf", reason="gguf is a pdserve dependency: install pdserve")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.common.model.test_gguf import write_llama_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(
    ON_CUDA or not cpu_quant.available(), reason="the GEMV and its packages are the CPU's"
)


def _tokens(llm: LLM) -> list[int]:
    (out,) = llm.generate([PROMPTS[PROMPT]], GREEDY)
    return list(out.token_ids)


# The suite's 600 s cut a cold compile at load 30 before its own wait (COMPILE_WAIT_S) ended.
@pytest.mark.timeout(COMPILE_WAIT_S + 300)
def test_a_gguf_model_compiles_through_the_gemv_with_eager_tokens(
    tiny_model_dir, tmp_path: Path
) -> None:
    path = str(write_llama_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", Q.Q4_1))
    common = {"dtype": "float32", "max_num_seqs": 1, "skip_tokenizer_init": True}
    with LLM(path, compile_mode="eager", **common) as eager:
        want = _tokens(eager)
    root = tmp_path / "cache"
    with start(path, root) as llm:
        runner = llm.engine.runner
        gemv = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear) and m.gemv]
        assert gemv and all(m.bits == 4 for m in gemv)  # Q4_1 held at its bits, on the GEMV
        assert gemv_paths(runner.model) == "avx2"  # float32: the exact path
        compiled = runner.compiled
        assert compiled is not None and compiled.background, "a GGUF model was kept eager"
        assert compiled.background.wait(COMPILE_WAIT_S), "the background compile did not finish"
        steps: list[bool] = []
        runs = compiled.runs
        compiled.runs = lambda batch: steps.append(runs(batch)) or steps[-1]
        got = _tokens(llm)
        assert steps and all(steps), steps  # every decode step ran the package
        # The package reads the model's own packed weights: no copy of them was made.
        (package,) = compiled.packages.values()
        names = package.loader.get_constant_fqns()
        assert "model.model.layers.0.mlp.down_proj.qweight" in names, names[:8]
    assert got == want
    with start(path, root) as second:
        compiled = second.engine.runner.compiled
        assert compiled.background is None, "a second start compiled again"
        counts = compiled.cache_counts
        assert (counts.hits, counts.misses) == (1, 0)
        assert _tokens(second) == want


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

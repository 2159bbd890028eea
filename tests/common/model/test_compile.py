"""Compiled decode steps (common/engine/compiled_decode.py): the logits and greedy tokens of eager
mode and of HF, one graph per bucket whatever the batch's composition, the attention op's fake,
and the switch that keeps a runner eager.

One compiled engine serves the module (compiling its three buckets takes most of the time)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.bench.compile_start import start_once
from pdserve.common.engine import background_compile, compiled_decode
from pdserve.common.engine.compile_cache import CacheCounts, CompileCache
from pdserve.common.engine.compiled_decode import decode_buckets, hash_files, traced_files
from pdserve.common.engine.config import EAGER_ENV, ModelConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.model_runner import ForwardInputs, ModelRunner
from pdserve.common.engine.scheduler import ScheduledSeq
from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.node.cli import add_engine_args, engine_configs
from pdserve.common.wire.payloads import SamplingParams
from pdserve.serve import _engine_flags, build_parser
from tests.common.test_llm_equivalence import GREEDY, PROMPTS, VOCAB, assert_matches_hf
from tests.devices import ON_CUDA, engine_kwargs, require_device

MAX_SEQS = 4  # buckets 1, 2, 4: a batch of 3 runs padded to 4
BLOCK_SIZE = 16
# Qwen2: q/k/v biases (the few-row linear with a bias); one full and one sliding layer
# (the attention op with and without a window in one graph).
QWEN2_SLIDING = {"vocab": VOCAB, "sliding_window": 8, "max_window_layers": 1}
# tests/bench/test_bench_compile.py compiles this model's bucket 1 into the same compile cache:
# the two modules are one xdist group, so two workers do not compile that package at once.
SHARES_QWEN2_PACKAGES = pytest.mark.xdist_group("qwen2_packages")
pytestmark = SHARES_QWEN2_PACKAGES
# A cold bucket of a tiny model, at nice 19 beside other tests (a background compile's child
# runs at nice 19 whatever its parent's): at load 30 one took longer than the suite's 600 s
# (pyproject.toml). A test that may be the first to wait for a compile is given the wait and
# 300 s more.
COMPILE_WAIT_S = 1200
waits_for_a_compile = pytest.mark.timeout(COMPILE_WAIT_S + 300)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Compiled CPU kernels split their loops over the threads (OpenMP); on a machine where
    other tests keep the cores busy that costs up to seconds a step. One thread keeps this
    module's time steady (the kernels are generated for the thread count at compile time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("qwen2", **QWEN2_SLIDING))


@pytest.fixture(scope="module")
def compiled(model_dir: str) -> LLM:
    """On PDSERVE_TEST_DEVICE; on CUDA its buckets are also captured as CUDA graphs."""
    require_device()
    kwargs = {**engine_kwargs(), "max_num_seqs": MAX_SEQS}
    return LLM(model_dir, enforce_eager=False, skip_tokenizer_init=True, **kwargs)


def test_buckets_are_powers_of_two_up_to_max_num_seqs() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(4) == (1, 2, 4)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


# -- numerics -------------------------------------------------------------------------------------


def decode_batch(runner: ModelRunner, contexts: list[int], first_block: int) -> ForwardInputs:
    """Prefill sequences of the given lengths (eager), and return their decode step: one new
    token each. Each sequence gets its own blocks from first_block on."""
    seqs, decodes = [], []
    block = first_block
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, n in enumerate(contexts):
        blocks = tuple(range(block, block + n // BLOCK_SIZE + 1))
        block += len(blocks)
        tokens = tuple((7 * i + 3 * j) % VOCAB for j in range(n))
        if n > 1:
            seqs.append(ScheduledSeq(f"p{i}", tokens[:-1], 0, blocks, False, params))
        decodes.append(ScheduledSeq(f"d{i}", tokens[-1:], n - 1, blocks, True, params))
    prefill = runner.prepare(tuple(seqs))
    runner.model(prefill.input_ids, prefill.positions, prefill.attn, runner.kv_caches)
    return runner.prepare(tuple(decodes))


@waits_for_a_compile
@torch.inference_mode()
def test_compiled_logits_equal_eager_for_any_batch_composition(compiled: LLM) -> None:
    runner = compiled.engine.runner
    assert runner.compiled is not None and runner.compiled.num_compiles == 3  # the warm-up
    assert (runner.compiled.graphs is not None) == ON_CUDA
    # Batch sizes that fit a bucket and ones padded up to it; contexts from one block to
    # several, so block tables and sequence lengths change shape between steps.
    for contexts in ([5], [40, 3], [17, 70, 2], [33, 1, 90, 16], [120, 64, 9]):
        inputs = decode_batch(runner, contexts, first_block=1)
        args = (inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches)
        eager = runner.model.compute_logits(runner.model(*args))
        got = runner.compiled.logits(*args)
        assert got.shape == eager.shape
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert runner.compiled.num_compiles == 3, "a batch composition made a bucket recompile"


@waits_for_a_compile
def test_greedy_tokens_equal_hf_with_compiled_decode(
    compiled: LLM, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled_batches: list[int] = []
    runner = compiled.engine.runner
    inner = runner.compiled.logits

    def counted(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        compiled_batches.append(input_ids.shape[0])
        return inner(input_ids, *args)

    monkeypatch.setattr(runner.compiled, "logits", counted)
    outs = compiled.generate(PROMPTS, GREEDY)
    assert_matches_hf(model_dir, outs)
    assert {3, 4} <= set(compiled_batches), compiled_batches  # 3: padded to bucket 4
    assert runner.compiled.num_compiles == 3
    compiled.engine.check_integrity()


# -- the compile cache ----------------------------------------------------------------------------


@waits_for_a_compile
def test_a_second_start_compiles_nothing(compiled: LLM, model_dir: str) -> None:
    """`compiled` was the first start: it compiled its buckets, or loaded them from an earlier
    session's cache. A second start in a fresh process (same model, flags, thread count and
    cache folder: the suite's $PDSERVE_COMPILE_CACHE_DIR) loads all three and compiles none;
    on the CPU without importing the compiler (what made a warm start 4.5x an eager one)."""
    counts = compiled.engine.runner.compiled.cache_counts
    assert counts is not None and counts.hits + counts.misses == 3, counts
    engine = {**engine_kwargs(), "max_num_seqs": MAX_SEQS, "enforce_eager": False}
    second = start_once(model_dir, engine, timeout_s=600, threads=torch.get_num_threads())
    assert (second.hits, second.misses) == (3, 0)
    assert second.compiler_imported == ON_CUDA


def test_the_code_hash_covers_the_model_package(tmp_path: Path) -> None:
    """A CPU package is found by the key alone: a change to any traced source (the model's
    layers, the attention op's fake, the export) must change the key."""
    names = {f.name for f in traced_files()}
    made_by = {"compiled_decode.py", "background_compile.py", "compile_child.py", "cuda_graphs.py"}
    assert made_by | {"llama.py", "attention.py"} <= names
    assert {"parallel.py", "quant.py", "ops.py", "cpu.py"} <= names  # and kernels/
    assert "cpu_quant.cpp" in names  # the GEMV's C++, which a GGUF model's package calls
    assert "cpu_simd.h" in names  # the vector code the kernels' sources paste in
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    for f in files:
        f.write_text("x = 1\n")
    before = hash_files(files)
    files[1].write_text("x = 2\n")
    assert hash_files(files) != before


def _bucket_one(compiled: LLM) -> tuple[ModelRunner, CompileCache, Path]:
    runner = compiled.engine.runner
    cache = runner.compiled.cache
    assert cache is not None
    return runner, cache, background_compile.package_file(cache.path, 1)


@waits_for_a_compile
@pytest.mark.skipif(ON_CUDA, reason="CPU packages")
def test_a_package_loads_only_onto_the_model_it_was_made_for(compiled: LLM) -> None:
    _, _, path = _bucket_one(compiled)
    with pytest.raises(RuntimeError, match="wants tensors the model does not have"):
        compiled_decode.DecodePackage(path, torch.nn.Linear(2, 2))


@waits_for_a_compile
@pytest.mark.skipif(ON_CUDA, reason="CPU packages")
@torch.inference_mode()
def test_an_unreadable_package_is_compiled_again(
    compiled: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged package costs a compile, never a failed start. (The compile is stood in for
    by a copy of the real bucket-1 package: it takes minutes.)"""
    runner, good_cache, good = _bucket_one(compiled)
    cache = CompileCache(tmp_path, good_cache.key)
    cache.path.mkdir(parents=True)
    background_compile.package_file(cache.path, 1).write_bytes(b"not a package")
    made: list[int] = []

    def copy(model: object, size: int, kv: object, into: CompileCache) -> None:
        made.append(size)
        background_compile.package_file(into.path, size).write_bytes(good.read_bytes())

    monkeypatch.setattr(background_compile, "compile_package", copy)
    packages, counts = compiled_decode.load_packages(runner.model, (1,), runner.kv_caches, cache)
    assert counts == CacheCounts(hits=0, misses=1) and made == [1]
    inputs = decode_batch(runner, [20], first_block=1)
    args = (inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches)
    eager = runner.model.compute_logits(runner.model(*args))
    torch.testing.assert_close(packages[1](*args), eager, rtol=1e-5, atol=1e-5)


# -- the switch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("enforce_eager,compile_mode", [(True, None), (None, "eager")])
def test_eager_asked_compiles_nothing(
    model_dir: str,
    enforce_eager: bool | None,
    compile_mode: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(EAGER_ENV)  # the device's own default, not the suite's
    # Imported here: torch._dynamo imported while tests are collected would load Triton before
    # tests/kernels sets TRITON_INTERPRET.
    from torch._dynamo.utils import counters

    llm = LLM(
        model_dir, enforce_eager=enforce_eager, compile_mode=compile_mode, skip_tokenizer_init=True
    )
    assert llm.engine.runner.compiled is None
    graphs = counters["stats"]["unique_graphs"]
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4
    assert counters["stats"]["unique_graphs"] == graphs, "an eager engine compiled a graph"


def test_enforce_eager_defaults_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EAGER_ENV)
    assert ModelConfig("m").decode_compile == "background"
    assert ModelConfig("m", device="cuda").decode_compile == "blocking"
    assert ModelConfig("m", enforce_eager=False).decode_compile == "blocking"
    assert not ModelConfig("m", device="cuda:1", enforce_eager=True).compile_decode
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig("m", enforce_eager=1)


def test_compile_mode_wins_over_all_but_enforce_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EAGER_ENV, "1")
    assert ModelConfig("m", compile_mode="background").decode_compile == "background"
    assert ModelConfig("m", compile_mode="blocking", enforce_eager=False).compile_decode
    assert ModelConfig("m", compile_mode="background", enforce_eager=True).decode_compile == "eager"
    assert not ModelConfig("m", device="cuda", compile_mode="eager").compile_decode
    with pytest.raises(ValueError, match="compile_mode"):
        ModelConfig("m", compile_mode="lazy")
    with pytest.raises(ValueError, match="CPU only"):
        ModelConfig("m", device="cuda", compile_mode="background")


def test_eager_env_decides_only_what_the_flag_left_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EAGER_ENV, "0")
    assert ModelConfig("m").compile_decode
    assert not ModelConfig("m", enforce_eager=True).compile_decode
    monkeypatch.setenv(EAGER_ENV, "1")
    assert not ModelConfig("m", device="cuda").compile_decode
    assert ModelConfig("m", enforce_eager=False).compile_decode


@pytest.mark.parametrize(
    "flags,expected", [([], None), (["--enforce-eager"], True), (["--no-enforce-eager"], False)]
)
def test_cli_flag_reaches_model_config_and_serve_passes_it_on(
    flags: list[str], expected: bool | None
) -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(flags)
    args.model = "m"
    assert engine_configs(args)[0].enforce_eager is expected
    serve_args = build_parser().parse_args(["m", *flags])
    assert [f for f in _engine_flags(serve_args) if "eager" in f] == flags


# -- the attention op -----------------------------------------------------------------------------


def test_attention_op_fake_and_schema() -> None:
    """opcheck: the fake gives the real output's shape, dtype and strides (also for a
    non-contiguous query and for padded rows), and the schema declares the cache write."""
    torch.manual_seed(0)
    heads, kv_heads, dim, blocks = 4, 2, 16, 6
    kv_cache = torch.zeros(2, blocks, BLOCK_SIZE, kv_heads, dim)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor([17, 40]),
        block_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([2, 9], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=9,
    )
    for rows in (2, 4):  # 4: two padding rows
        query = torch.randn(heads, rows, dim).transpose(0, 1)  # not contiguous
        key, value = torch.randn(2, rows, kv_heads, dim).unbind(0)
        args = (query, key, value, kv_cache, *attn.tensors(), dim**-0.5, None)
        torch.library.opcheck(torch.ops.pdserve.paged_attention.default, args)
        out = torch.ops.pdserve.paged_attention.default(*args)
        assert out.is_contiguous() and torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.equal(kv_cache[0].flatten(0, 1)[17], key[0])  # the op wrote the cache

"""Speculative decoding on a decode node (issue 38): router + prefill + decode processes on
loopback, the decode node run with --speculative-config. ngram and suffix keep no draft KV, so
the decode node drafts on its own steps: greedy answers equal the colocated engine's without
speculation, the node's /metrics count accepted drafts, and every pool is clean after."""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest

from pdserve.bench.systems import wait_until
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import (
    ENGINE,
    MAX_TOKENS,
    _nccl,
    assert_clean,
    complete,
    run_concurrently,
)
from tests.kv_transfer.helpers import needs_nixl

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
PROMPTS = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7 + [9], [300, 301, 302, 303, 304, 305] * 5, [17]]


def _metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(name)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_decode_node_drafts_and_equals_colocated(tmp_path) -> None:
    model = str(make_tiny_model("llama", tmp_path / "m", max_position=2048))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model, block_size=16, skip_tokenizer_init=True, dtype="float32") as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, params)]
    health = free_port()
    decode = ["--speculative-config", SPEC, "--health-port", str(health)]
    with LocalCluster(model, 1, 1, engine_args=ENGINE, decode_args=decode) as c:
        results = run_concurrently(c, PROMPTS)
        assert [r["choices"][0]["token_ids"] for r in results] == reference
        accepted = "pdserve_node_spec_decode_num_accepted_tokens"
        # The gauges are published with each heartbeat: wait for one after the requests.
        wait_until(lambda: _metric(health, accepted) > 0, c.procs, 30, "drafts accepted")
        assert_clean(c)


# draft_model: the prefill node computes the draft's KV with the target's and ships it as the
# layers after the target's; the decode node drafts from it without recomputing.
DRAFT_PROMPTS = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7 + [9], [17], [101, 57, 3, 98, 250, 7, 77]]
DRAFT_TOKENS = 16
DRAFTS = "pdserve_node_spec_decode_num_drafts"
ACCEPTED = "pdserve_node_spec_decode_num_accepted_tokens"
# Every connector ships the page group: nccl runs on gloo on the CPU (NCCL needs two GPUs),
# nixl where its extra is installed (CI installs it).
NCCL = pytest.param("nccl", marks=_nccl().marks)
CONNECTORS = ["zmq", NCCL, "shm", pytest.param("nixl", marks=needs_nixl)]
TP_THREADS = ["--threads-per-rank", "1"]  # two ranks on a 2-core machine


def _reached(port: int, name: str, value: float) -> bool:
    return _metric(port, name) >= value


def _colocated_counts(model: str, spec: str) -> tuple[list[list[int]], list[float], list[float]]:
    """Greedy tokens and the running totals of drafts and accepted drafts after each prompt,
    one prompt at a time, chunked as the prefill node chunks (ENGINE's flags)."""
    params = SamplingParams(max_tokens=DRAFT_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, drafts, accepted = [], [], []
    options = {"block_size": 16, "max_num_batched_tokens": 96, "speculative_config": spec}
    options["dtype"] = "float32"  # as ENGINE's nodes: `auto` is bf16 on a CPU with native bf16
    with LLM(model, skip_tokenizer_init=True, **options) as llm:
        stats = llm.engine.scheduler.drafter.stats
        for prompt in DRAFT_PROMPTS:
            tokens.append(llm.generate([prompt], params)[0].token_ids)
            drafts.append(stats.num_drafts)
            accepted.append(stats.num_accepted_tokens)
    return tokens, drafts, accepted


@pytest.fixture(scope="module")
def draft_colocated(tmp_path_factory) -> dict:
    """The target as its own draft, colocated: greedy tokens (equal without speculation) and
    the running totals of drafts and accepted drafts. Every draft is accepted where the draft
    pages hold the prompt's KV (a random smaller draft would accept next to none on a random
    target)."""
    model = str(make_tiny_model("llama", tmp_path_factory.mktemp("draft") / "m", max_position=2048))
    spec = json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=DRAFT_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model, block_size=16, skip_tokenizer_init=True, dtype="float32") as llm:
        plain = [o.token_ids for o in llm.generate(DRAFT_PROMPTS, params)]
    tokens, drafts, accepted = _colocated_counts(model, spec)
    assert tokens == plain
    assert accepted[-1] > 0, "no draft accepted colocated: the test would show nothing"
    return {"model": model, "spec": spec, "plain": plain, "drafts": drafts, "accepted": accepted}


def _through_1p1d(colocated: dict, connector: str, prefill_args: list[str]) -> None:
    """The prompts one at a time through 1P1D: each answer equals colocated's, and so does
    the decode node's running total of accepted drafts after it; every pool is clean after."""
    health = free_port()
    engine = [*ENGINE, "--speculative-config", colocated["spec"]]
    decode = ["--health-port", str(health)]
    args = {"engine_args": engine, "prefill_args": prefill_args, "decode_args": decode}
    with LocalCluster(colocated["model"], 1, 1, kv_connector=connector, **args) as c:
        got = []
        for i, prompt in enumerate(DRAFT_PROMPTS):
            out = complete(c.url, prompt, max_tokens=DRAFT_TOKENS)
            assert out["choices"][0]["token_ids"] == colocated["plain"][i]
            # The gauges come with each heartbeat: wait for this request's verify steps.
            seen = partial(_reached, health, DRAFTS, colocated["drafts"][i])
            wait_until(seen, c.procs, 30, f"drafts of prompt {i}")
            got.append(_metric(health, ACCEPTED))
        assert got == colocated["accepted"]
        assert _metric(health, DRAFTS) == colocated["drafts"][-1]
        assert_clean(c)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_draft_model_kv_through_1p1d_keeps_colocated_acceptance(draft_colocated, connector):
    """Greedy tokens through 1P1D (every connector) equal colocated with and without
    speculation, and the accepted drafts of each request equal colocated's exactly: the decode
    node drafts from the shipped draft pages. (The negative control, a decode side whose draft
    pages are zeros as a fresh pool holds them when they are not shipped, is
    tests/common/spec/test_draft_model.py::test_acceptance_depends_on_the_draft_pages.)"""
    _through_1p1d(draft_colocated, connector, [])


def test_draft_model_kv_from_tp2_prefill_to_tp1_decode(draft_colocated) -> None:
    """P at TP 2, D at TP 1: each prefill rank computes its KV heads of the draft's pages with
    the target's and ships them; the decode node drafts from both ranks' halves and accepts
    what colocated accepts."""
    _through_1p1d(draft_colocated, "zmq", ["--tensor-parallel-size", "2", *TP_THREADS])

"""Speculative decoding on a decode node (issue 38): router + prefill + decode processes on
loopback, the decode node run with --speculative-config. ngram and suffix keep no draft KV, so
the decode node drafts on its own steps: greedy answers equal the colocated engine's without
speculation, the node's /metrics count accepted drafts, and every pool is clean after."""

from __future__ import annotations

import json

import httpx

from pdserve.bench.systems import wait_until
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import ENGINE, MAX_TOKENS, assert_clean, run_concurrently

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
PROMPTS = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7 + [9], [300, 301, 302, 303, 304, 305] * 5, [17]]


def _metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(name)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_decode_node_drafts_and_equals_colocated(tmp_path) -> None:
    model = str(make_tiny_model("llama", tmp_path / "m", max_position=2048))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model, block_size=16, skip_tokenizer_init=True) as llm:
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

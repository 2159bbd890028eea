"""Speculation under structured outputs through real processes (issue 38), every node run with
ngram drafts at k = 3: colocated and 1P1D, 50 of 50 JSON-schema answers are valid and equal the
in-process engine's without drafts, a forced tool call parses, the router's /metrics sums the
nodes' counters, the router's prefix view holds only blocks of verified tokens after drafts
were rejected, and every pool is back to its baseline; in 1P2D a stream whose decode node is
killed (SIGKILL) mid-answer ends with the text it has without the fault."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.bench.systems import wait_until
from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.engine.llm import LLM
from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams
from pdserve.local_cluster import LocalCluster
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import assert_reports_clean
from tests.e2e.test_structured import (
    CASES,
    ENGINE,
    MAX_TOKENS,
    PROMPT,
    SCHEMA,
    resumed_after_its_decode_node_died,
)

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
NODES = [*ENGINE, "--heartbeat-interval", "0.2", "--speculative-config", SPEC]
ROUTER = ["--heartbeat-timeout", "1.5", "--lease-interval", "0.3"]
JSON_CASE = "response_format json_schema"
PROMPTS = [f"Describe person {i} as JSON:" for i in range(50)]
# Token prompts the tiny model loops on: its drafts are accepted and rejected in turn.
LOOPING = [[5, 6, 7, 8] * 10, [9, 10, 11] * 7 + [9], [300, 301, 302, 303, 304, 305] * 5, [17]]
BLOCK = 16  # ENGINE's --block-size
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("sps") / "m", max_position=2048))


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, list[int]]:
    """Greedy JSON answers of the in-process engine without speculation, by prompt."""
    json_params = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=json_params)
    with LLM(model_dir, block_size=BLOCK, dtype="float32") as llm:
        outs = llm.generate([PROMPT, *PROMPTS], params)
    return {p: o.token_ids for p, o in zip([PROMPT, *PROMPTS], outs, strict=True)}


def _post(url: str, path: str, body: dict) -> dict:
    resp = httpx.post(url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def rejected_drafts_stay_out_of_the_prefix_view(cluster: LocalCluster) -> None:
    """After requests whose drafts were partly rejected, every block hash the router holds
    for a node is a block of some request's verified tokens (prompt and output), and blocks
    the decoding produced are among them (the view is not merely empty)."""
    body = {"max_tokens": 48, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    verified, produced = set(), set()
    for prompt in LOOPING:
        choice = _post(cluster.url, "/v1/completions", {**body, "prompt": prompt})["choices"][0]
        blocks = hash_token_blocks([*prompt, *choice["token_ids"]], BLOCK)
        verified.update(h.hex() for h in blocks)
        produced.update(h.hex() for h in blocks[len(prompt) // BLOCK :])
    drafted = _metric(cluster.url, "pdserve_backend_spec_decode_num_draft_tokens")
    accepted = _metric(cluster.url, "pdserve_backend_spec_decode_num_accepted_tokens")
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts were accepted and rejected

    def view() -> set[str]:
        return {h for info in cluster.integrity().values() for h in info["prefix_view"]}

    wait_until(lambda: view() & produced, cluster.procs, 30, "output blocks in the view")
    assert view() <= verified, view() - verified


def fifty_json_answers(cluster: LocalCluster, reference: dict[str, list[int]]) -> None:
    fields, _ = CASES[JSON_CASE]
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, **fields}

    def ask(prompt: str) -> dict:
        return _post(cluster.url, "/v1/completions", {**body, "prompt": prompt})["choices"][0]

    # The first one alone: a node's first grammar scans the tokenizer (seconds on a loaded
    # box), and a reservation the router waits on past its reply timeout counts as no room.
    choices = [ask(PROMPTS[0])]
    with ThreadPoolExecutor(max_workers=4) as pool:
        choices += pool.map(ask, PROMPTS[1:])
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        assert choice["token_ids"] == reference[prompt], prompt
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["text"])
        assert set(value) == {"name", "age", "tags"} and 0 <= value["age"] <= 120


def forced_tool_call_parses(cluster: LocalCluster) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        body = {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": choice,
            "max_tokens": 64,
            "temperature": 0,
        }
        answer = _post(cluster.url, "/v1/chat/completions", body)["choices"][0]
        assert answer["finish_reason"] == "tool_calls", answer
        (call,) = answer["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city"}


def counters_reach_the_router(cluster: LocalCluster) -> None:
    """The router sums the nodes' counters; accepted drafts by position add up to the
    accepted drafts (read once the heartbeats after the requests are in)."""
    name = "pdserve_backend_spec_decode_num_accepted_tokens"
    time.sleep(1.0)  # heartbeats every 0.2 s: the last step's counters are in
    total = _metric(cluster.url, name)
    per_position = sum(_metric(cluster.url, f"{name}_per_pos_{i}") for i in range(3))
    assert total > 0 and per_position == total


@pytest.mark.parametrize("shape", ["colocated", "1P1D"])
def test_structured_outputs_with_drafts(model_dir, reference, shape) -> None:
    p, d, c = {"colocated": (0, 0, 1), "1P1D": (1, 1, 0)}[shape]
    with LocalCluster(
        model_dir, p, d, num_colocated=c, engine_args=NODES, router_args=ROUTER
    ) as cluster:
        rejected_drafts_stay_out_of_the_prefix_view(cluster)
        fifty_json_answers(cluster, reference)
        forced_tool_call_parses(cluster)
        counters_reach_the_router(cluster)
        assert_reports_clean(cluster.integrity(), len(cluster.procs) - 1)


def test_a_killed_decode_node_mid_stream_with_drafts(model_dir, reference) -> None:
    """1P2D: the decode node drafting a JSON answer is killed after a few tokens; the other
    decode node resumes it (rebuilding its grammar from the streamed tokens) and the text is
    the one without the fault; the surviving nodes hold nothing after."""
    with LocalCluster(model_dir, 1, 2, engine_args=NODES, router_args=ROUTER) as cluster:
        with LLM(model_dir, block_size=BLOCK, dtype="float32") as llm:
            (want,) = llm.generate(
                [PROMPT],
                SamplingParams(
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    structured_outputs=StructuredOutputsParams(json=SCHEMA),
                ),
            )
        assert want.token_ids == reference[PROMPT]
        cases = {JSON_CASE: (want.token_ids, want.text, want.finish_reason)}
        resumed_after_its_decode_node_died(cluster, cases)
        deadline = time.monotonic() + 30
        while len(reports := cluster.integrity()) != 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # until the router has taken the killed node for dead
        assert_reports_clean(reports, 2)
        # No count of accepted drafts here: the router sums live nodes only, and the killed
        # node may have made all of them (0 in a CI run); the tests above show drafts accepted.

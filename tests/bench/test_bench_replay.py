"""`pdserve bench replay`: traces parsed and scaled, prompts synthesized block by block, and a
captured request log replayed against a fresh deployment with its lengths and prefix hits."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from pdserve.bench import load, replay
from pdserve.local_cluster import LocalCluster
from pdserve.tiny_model import make_tiny_model
from tests.devices import engine_flags

# The first lines of FAST25-release/traces/conversation_trace.jsonl, in its format.
MOONCAKE = """\
{"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]}
{"timestamp": 250, "input_length": 1536, "output_length": 3, "hash_ids": [0, 1, 4]}
{"timestamp": 100, "input_length": 700, "output_length": 20, "hash_ids": [0, 5]}
"""


class Pool:
    """A TokenPool's `token_ids`: random ids from the rng it is given."""

    def token_ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]


def test_a_mooncake_trace_is_parsed_in_arrival_order() -> None:
    trace = replay.parse(MOONCAKE.splitlines())
    assert [r.at for r in trace] == [0.0, 0.1, 0.25]  # ms -> s, sorted
    assert [r.input_len for r in trace] == [1100, 700, 1536]
    assert [r.output_len for r in trace] == [50, 20, 3]
    assert {r.block_size for r in trace} == {512}
    assert [r.hash_ids for r in trace] == [(0, 1, 2), (0, 4), (0, 1, 3)]  # ids as first seen
    assert all(r.cached_tokens is None for r in trace)


def test_a_line_of_neither_format_is_refused() -> None:
    with pytest.raises(ValueError, match="line 2"):
        replay.parse([MOONCAKE.splitlines()[0], '{"prompt": "hi"}'])
    with pytest.raises(ValueError, match="no request"):
        replay.parse([""])


def test_scaled_prompts_share_exactly_the_blocks_their_hash_ids_share() -> None:
    trace = [replay.scaled(r, 2.0, 1 / 64, 0.1) for r in replay.parse(MOONCAKE.splitlines())]
    assert [(r.at, r.block_size) for r in trace] == [(0.0, 8), (0.2, 8), (0.5, 8)]
    assert [(r.input_len, r.output_len) for r in trace] == [(17, 5), (11, 2), (24, 1)]
    a, b, c = (replay.synthesize(r, i, Pool(), seed=0) for i, r in enumerate(trace))
    assert [len(p) for p in (a, b, c)] == [17, 11, 24]
    assert a[:16] == c[:16] and a[16:17] != c[16:17]  # ids 0, 1 shared; 2 against 4
    assert a[:8] == b[:8] and a[8:11] != b[8:11]  # id 0 shared; 1 against 3
    assert replay.synthesize(trace[0], 0, Pool(), seed=1)[:8] != a[:8]  # the seed's blocks


def test_stage_means_are_the_runs_own() -> None:
    before = {"prefill_sum": 1.0, "prefill_count": 2.0}
    after = {"prefill_sum": 2.5, "prefill_count": 5.0, "node_inbox_sum": 0.3}
    after["node_inbox_count"] = 3.0
    assert replay.stage_means(before, after) == {"prefill": 500.0, "node_inbox": 100.0}


# -- a captured log replayed -----------------------------------------------------------------

ENGINE = ["--block-size", "8", "--max-model-len", "512", *engine_flags()]
# Two conversations of three turns, each turn's prompt the one before plus new blocks.
CONVERSATIONS = [
    [(0, 1), (0, 1, 2, 3), (0, 1, 2, 3, 4, 5)],
    [(0, 6), (0, 6, 7), (0, 6, 7, 8, 9)],
]


def _original_trace() -> list[replay.TraceRequest]:
    turns = [t for turns in zip(*CONVERSATIONS, strict=True) for t in turns]
    return [
        replay.TraceRequest(0.0, 8 * len(ids) + 3, 4, 8, ids) for ids in turns
    ]  # 3 tokens of each prompt are its own


def _run(model: Path, log: Path, trace, requests) -> dict:
    router = ["--policy", "round_robin", "--request-log", str(log)]
    with LocalCluster(str(model), 0, 0, 1, engine_args=ENGINE, router_args=router) as c:
        return asyncio.run(replay.replay(c.url, trace, requests, 1, 120))


def test_a_captured_log_replays_with_its_lengths_and_prefix_hits(tmp_path) -> None:
    model = make_tiny_model("llama", tmp_path / "m", max_position=1024)
    pool = load.load_pool(str(model))
    trace = _original_trace()
    original = _run(model, tmp_path / "original.jsonl", trace, replay.requests_of(trace, pool, 7))
    lines = [json.loads(x) for x in (tmp_path / "original.jsonl").read_text().splitlines()]
    assert len(lines) == len(trace) and {x["outcome"] for x in lines} == {"finished"}
    assert all("prompt" not in x and "text" not in x for x in lines)  # no text in the log
    assert {(x["block_size"], x["prefill_node"]) for x in lines} == {(8, "both0")}
    assert original["hit_rate"] > 0.3, original  # later turns hit their conversation's blocks

    argv = [str(tmp_path / "original.jsonl"), "--model", str(model), "--policies", "round_robin"]
    argv += ["--colocated", "1", "--prefill", "0", "--decode", "0", "--max-concurrency", "1"]
    argv += ["--out", str(tmp_path / "replayed.json"), "--engine-args", *ENGINE]
    result = replay.main(argv)
    (run,) = result["runs"]
    assert run["completed"] == len(trace), run["errors"]
    assert run["lengths"] == [[x["prompt_tokens"], x["output_tokens"]] for x in lines]
    assert result["original_hit_rate"] == pytest.approx(original["hit_rate"], abs=1e-3)
    assert abs(run["hit_rate"] - original["hit_rate"]) <= 0.02, (run, original)
    assert run["stage_mean_ms"]["prefill"] > 0 and "node_inbox" in run["stage_mean_ms"]

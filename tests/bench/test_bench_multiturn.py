"""pdserve bench multiturn (scripts/bench_multiturn.py): the counters' arithmetic on made-up
numbers, and a --quick run of the two always-remote 1P1D systems on the tiny model (2
conversations x 2 turns): the report has its fields, and after the first turn the decode node
with a prefix cache received fewer KV bytes than the one without."""

from __future__ import annotations

import json

from pdserve.bench import multiturn as mt

TURN_KEYS = {
    "turn",
    "completed",
    "failed",
    "kv_bytes",
    "prefills_local",
    "prefills_remote",
    "kv_tokens_reused_on_decode",
    "kv_tokens_sent",
    "mean_ttft_ms",
    "median_ttft_ms",
    "output_tokens_per_s",
    "replies",
}


def test_scrape_sums_a_metric_over_its_label_sets() -> None:
    text = (
        "# HELP pdserve_node_kv_received_bytes KV page bytes\n"
        'pdserve_node_kv_received_bytes{node_id="d0",role="decode"} 16384.0\n'
        'pdserve_node_kv_received_bytes{node_id="d1",role="decode"} 100.0\n'
        "pdserve_backend_prefills_local 3.0\n"
    )
    assert mt.scrape(text, "pdserve_node_") == {"kv_received_bytes": 16484.0}
    assert mt.scrape(text, "pdserve_backend_") == {"prefills_local": 3.0}


def _turn(turn: int, replies: list[tuple[int, int, str]], **values: float) -> dict:
    """A turn record: replies as (prompt tokens, output tokens, text)."""
    rs = [
        {"conversation": c, "prompt_tokens": p, "output_tokens": o, "text": x, "error": ""}
        for c, (p, o, x) in enumerate(replies)
    ]
    return {"turn": turn, "failed": 0, "replies": rs, **values}


def test_reusable_tokens_are_the_full_blocks_of_prompt_and_answer() -> None:
    turns = [_turn(1, [(40, 8, "a"), (16, 1, "b")]), _turn(2, [(60, 8, "c"), (30, 8, "d")])]
    # (40 + 8 - 1) // 16 = 2 blocks; (16 + 1 - 1) // 16 = 1 block.
    assert mt.reusable_tokens(turns, 16) == [0, 48]


def test_answers_are_compared_per_conversation_and_turn() -> None:
    ref = {"turns": [_turn(1, [(9, 2, "x"), (9, 2, "y")])]}
    other = {"turns": [_turn(1, [(9, 2, "x"), (9, 2, "z")])]}
    got = mt.compare_answers({"colocated": ref, "remote": other})
    assert got == {"remote": {"compared": 2, "mismatches": 1, "where": [(1, 1)]}}
    assert mt.compare_answers({"remote": other}) == {}


def test_goals_read_later_turns_and_all_turns() -> None:
    def system(kv: list[float], ttft: list[float]) -> dict:
        turns = [
            _turn(t + 1, [], kv_bytes=b, mean_ttft_ms=m) for t, (b, m) in enumerate(zip(kv, ttft))
        ]
        later = {"kv_bytes_after_turn_1": sum(kv[1:]), "mean_ttft_ms_after_turn_1": ttft[1]}
        return {"turns": turns, "overall": {**later, "mean_ttft_ms": sum(ttft) / len(ttft)}}

    results = {
        "colocated": system([0, 0, 0], [100, 50, 50]),
        "remote-nocache": system([100, 200, 300], [90, 90, 90]),
        "remote": system([100, 10, 60], [90, 60, 60]),
        "conditional": system([100, 0, 0], [90, 40, 40]),
        "threshold": system([100, 10, 60], [90, 60, 45]),
    }
    status = {g["goal"]: g["status"] for g in mt.evaluate_goals(results, 3)}
    assert status == {
        "conditional: KV bytes of turns 2+ <= 10% of remote-nocache's": "met",
        "conditional: mean TTFT of turns 2+ <= colocated's": "met",
        "threshold: KV bytes of turns 2+ <= 10% of remote-nocache's": "missed",  # 70 / 500
        "threshold: mean TTFT of turns 2+ <= colocated's": "missed",  # 60 / 50
        "conditional: mean TTFT of all turns <= colocated's": "met",
    }
    del results["colocated"]
    assert [g["status"] for g in mt.evaluate_goals(results, 3)][-1] == "not measured"


def test_quick_run_moves_less_kv_with_the_decode_prefix_cache(tmp_path) -> None:
    out = tmp_path / "out"
    systems = ["remote-nocache", "remote"]
    argv = ["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    mt.main([*argv, "--systems", ",".join(systems)])

    data = json.loads((out / "multiturn.json").read_text())
    assert data["systems"] == systems and data["notes"] == []
    answer_len = mt.QUICK_WORKLOAD.answer_len
    for system in systems:
        turns = data["results"][system]["turns"]
        assert [t["turn"] for t in turns] == [1, 2]
        for t in turns:
            assert TURN_KEYS <= set(t)
            assert (t["completed"], t["failed"]) == (2, 0), t["errors"]
            assert t["output_tokens"] == 2 * answer_len
            assert (t["prefills_local"], t["prefills_remote"]) == (0, 2)  # forced remote
    nocache, remote = (data["results"][s]["turns"] for s in systems)
    assert nocache[0]["kv_bytes"] >= remote[0]["kv_bytes"] > 0
    # Turn 2: the decode node without a prefix cache gets the whole prompt again.
    assert nocache[1]["kv_bytes"] > remote[1]["kv_bytes"] > 0
    assert nocache[1]["kv_tokens_reused_on_decode"] == 0
    assert remote[1]["kv_tokens_reused_on_decode"] > 0
    goals = {g["goal"].split(":")[0]: g["status"] for g in data["goals"]}
    assert "remote" not in goals  # remote's share is shown, not a goal
    assert goals["conditional"] == goals["threshold"] == "not measured"

    doc = (out / "benchmarks.md").read_text()
    assert "<!-- BEGIN multiturn -->" in doc and "<!-- END multiturn -->" in doc
    assert "python scripts/bench_multiturn.py --quick" in doc
    assert "![multiturn](multiturn.png)" in doc
    assert (out / "multiturn.png").stat().st_size > 1000

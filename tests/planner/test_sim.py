"""The simulator: its timings against hand-computed ones, its KV admission, node lives (start
delay, drains, a node that never becomes ready), and its traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.replay import TraceRequest
from pdserve.planner.config import PlannerConfig
from pdserve.planner.drawing import draw, load_per_bin
from pdserve.planner.policy import Policy
from pdserve.planner.sim import NodeModel, Sim
from pdserve.planner.traces import mooncake, sinusoid

MODEL = NodeModel(
    prefill_rate=1000.0,
    prefill_overhead=0.0,
    transfer_rate=1e12,
    step_base=0.01,
    step_per_seq=0.0,
    step_per_ktok=0.0,
    kv_tokens=1000,
)


def trace(*requests: tuple[float, int, int]) -> list[TraceRequest]:
    return [TraceRequest(at, prompt, output, 1, ()) for at, prompt, output in requests]


def test_one_request_takes_its_prompt_at_the_rate_and_its_answer_in_steps() -> None:
    sim = Sim(trace((0.0, 500, 11)), MODEL, (1.0, 0.02), (1, 1))
    result = sim.run()
    (r,) = sim.requests
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot() == pytest.approx(0.01)
    assert result.end == pytest.approx(0.5 + 10 * 0.01)
    assert result.node_seconds == pytest.approx(2 * result.end)
    assert result.goodput == 1.0


def test_a_busy_prefill_node_queues_the_next_prompt() -> None:
    sim = Sim(trace((0.0, 400, 2), (0.1, 400, 2)), MODEL, (0.5, 0.02), (1, 1))
    result = sim.run()
    assert [r.ttft for r in sim.requests] == pytest.approx([0.4, 0.7])
    assert result.goodput == 0.5  # the second missed the 0.5 s TTFT


def test_decode_reserves_kv_first_a_request_waits_for_room() -> None:
    """Two requests of 600 KV tokens each on a node of 1000: the second starts its prefill
    only when the first has finished decoding and released its KV."""
    sim = Sim(trace((0.0, 100, 501), (0.0, 100, 501)), MODEL, (10.0, 0.02), (2, 1))
    sim.run()
    first, second = sim.requests
    assert first.ttft == pytest.approx(0.1)
    assert second.ttft == pytest.approx(0.1 + 500 * 0.01 + 0.1)


def test_a_larger_batch_steps_slower() -> None:
    model = NodeModel(
        prefill_rate=1e9,
        prefill_overhead=0.0,
        transfer_rate=1e12,
        step_base=0.01,
        step_per_seq=0.01,
        step_per_ktok=0.0,
        kv_tokens=10_000,
    )
    sim = Sim(trace((0.0, 10, 101), (0.0, 10, 101)), model, (1.0, 0.05), (1, 1))
    sim.run()
    assert [r.tpot() for r in sim.requests] == pytest.approx([0.03, 0.03], rel=1e-3)


def test_started_nodes_serve_after_the_start_delay_and_count_while_starting() -> None:
    """A burst that needs more prefill: the planner starts nodes; node-seconds count them
    from their start; none computes a prompt before start_delay has passed."""
    model = NodeModel(start_delay=30.0)
    burst = sinusoid(300.0, 20.0, 2048, 16, peak=1.0)
    config = PlannerConfig(ttft_slo=2.0, itl_slo=0.05, interval=10.0)
    sim = Sim(burst, model, (2.0, 0.05), (1, 1), Policy(config))
    result = sim.run()
    started = [n for n in sim.nodes if n.started_at > 0]
    assert started, "the planner started no node"
    grown = max(d.prefill or 0 for d in result.decisions)
    assert grown > 1
    assert result.node_seconds > 2 * result.end  # the started nodes' seconds count
    first_start = min(n.started_at for n in started)
    late = [r for r in sim.requests if r.at >= first_start + 30.0]
    assert late and min(r.ttft for r in late) < 2.0  # type: ignore[type-var]


def test_nodes_that_never_become_ready_are_stopped_and_replaced() -> None:
    """Every node the planner starts hangs. It keeps deciding each interval, stops each hung
    node once start_timeout has passed, and starts another in its place."""
    load = sinusoid(300.0, 6.0, 2048, 16, peak=1.0)
    config = PlannerConfig(start_timeout=60.0)
    sim = Sim(
        load,
        NodeModel(start_delay=5.0),
        (2.0, 0.05),
        (1, 1),
        Policy(config),
        never_ready=lambda i: True,
    )
    result = sim.run()
    hung = [n for n in sim.nodes if n.started_at > 0]
    stopped = [n for n in hung if n.gone_at is not None]
    assert len(stopped) >= 2 and not any(n.ready for n in hung)
    assert all(60.0 < n.gone_at - n.started_at <= 70.0 for n in stopped)  # type: ignore[operator]
    assert max(n.started_at for n in hung) > min(n.gone_at for n in stopped)  # type: ignore[type-var]
    times = [d.at for d in result.decisions]
    assert times == [10.0 * (i + 1) for i in range(len(times))]
    assert all(d.decided for d in result.decisions)


def test_the_sinusoid_swings_from_one_to_peak() -> None:
    requests = sinusoid(2400.0, 1.0, 100, 10, peak=8.0, period=1200.0, seed=3)
    trough = sum(r.at % 1200 < 60 or r.at % 1200 > 1140 for r in requests)
    crest = sum(540 < r.at % 1200 < 660 for r in requests)
    assert 6.0 < crest / trough < 10.5, (crest, trough)
    with pytest.raises(ValueError):
        sinusoid(10.0, 1.0, 100, 10, peak=0.5)


def test_a_mooncake_trace_is_read_by_the_replay_reader(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 1000 * i + 500,
            "input_length": 600 + i,
            "output_length": 20,
            "hash_ids": [0, i + 1],
        }
        for i in range(3)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = mooncake(path, limit=2, time_scale=2.0)
    assert [(r.at, r.input_len, r.output_len) for r in got] == [(0.0, 600, 20), (2.0, 601, 20)]


def test_a_run_is_drawn_with_its_load_per_minute_and_the_counts_it_decided(tmp_path: Path) -> None:
    """`compare --plot`: the load binned per minute, and a PNG of a planner's run."""
    requests = trace((0.0, 600, 2), (30.0, 600, 2), (61.0, 1200, 2))
    starts, per_s, tokens = load_per_bin(requests)
    assert starts == [0.0, 60.0]
    assert per_s == pytest.approx([2 / 60, 1 / 60]) and tokens == pytest.approx([20.0, 20.0])
    config = PlannerConfig(interval=10.0, window=10.0)
    result = Sim(requests, NodeModel(), (1.0, 0.05), (1, 1), Policy(config)).run()
    path = tmp_path / "run.png"
    draw(requests, [("from 1P1D", result.decisions)], (1, 1), "a run", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

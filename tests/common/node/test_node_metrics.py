"""NodeMetrics: a node's request histograms observed as StageClock's stages end, and the health
endpoint's counters (vLLM's names), read back from the Prometheus text they export."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.node.stages import NodeMetrics, StageClock
from pdserve.common.wire.messages import Tokens
from tests.common.node.test_stages import step

LABELS = {"role": "decode", "node_id": "d0"}


def samples(metrics: NodeMetrics) -> dict[tuple[str, str], float]:
    """(sample name, connector label or "") -> value, of every series exported."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, s.labels.get("connector", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_series_is_exported_at_zero_before_the_first_request() -> None:
    got = samples(NodeMetrics(LABELS, "zmq", block_bytes=1024))
    assert got[("pdserve:request_queue_time_seconds_count", "")] == 0
    assert got[("pdserve:kv_transfer_bytes_count", "zmq")] == 0
    assert got[("pdserve:kv_transfer_failures_total", "zmq")] == 0
    assert got[("pdserve:lease_expirations_total", "")] == 0
    assert got[("pdserve:engine_busy_seconds_total", "")] == 0


def test_a_computed_prompt_observes_its_queue_and_prefill_once() -> None:
    metrics = NodeMetrics({"role": "prefill", "node_id": "p0"}, "zmq", block_bytes=1024)
    clock = StageClock(None, "p0", metrics)
    clock.taken("r", None)
    step(clock, "r")
    clock.first_token(Tokens("r", (7,)))
    clock.first_token(Tokens("r", (8,)))  # later tokens observe nothing
    got = samples(metrics)
    assert got[("pdserve:request_queue_time_seconds_count", "")] == 1
    assert got[("pdserve:request_prefill_time_seconds_count", "")] == 1
    assert got[("pdserve:request_prefill_time_seconds_sum", "")] > 0


def test_a_decode_nodes_transfer_is_timed_and_sized_per_request_and_failures_counted() -> None:
    metrics = NodeMetrics(LABELS, "zmq", block_bytes=1024)
    clock = StageClock(None, "d0", metrics)
    clock.taken("a", None, remote=True)
    clock.kv_whole("a", ok=True, pages=3)
    step(clock, "a", tokens=1)
    clock.first_token(Tokens("a", (7,)))
    clock.taken("b", None, remote=True)
    clock.kv_whole("b", ok=False, pages=2)
    got = samples(metrics)
    assert got[("pdserve:kv_transfer_bytes_count", "zmq")] == 1
    assert got[("pdserve:kv_transfer_bytes_sum", "zmq")] == 3 * 1024
    assert got[("pdserve:kv_transfer_time_seconds_count", "zmq")] == 1
    assert got[("pdserve:kv_transfer_failures_total", "zmq")] == 1
    assert got[("pdserve:request_queue_time_seconds_count", "")] == 1  # its admission
    assert got[("pdserve:request_prefill_time_seconds_count", "")] == 0


def test_busy_seconds_grow_by_steps_that_ran_work_and_stay_still_on_empty_steps(
    monkeypatch,
) -> None:
    """A decode node's tokens per busy second (the planner's decode rate) needs the time of
    steps that ran a sequence, not the wall time: an empty step (nothing scheduled) adds none."""
    times = iter([10.0, 10.25, 20.0, 20.5, 30.0, 30.125])
    monkeypatch.setattr("pdserve.common.node.stages.time.monotonic", lambda: next(times))
    metrics = NodeMetrics(LABELS)
    clock = StageClock(None, "d0", metrics)
    step(clock, "a", tokens=1)  # 10.0 -> 10.25
    step(clock)  # nothing scheduled: 20.0 -> 20.5, not busy
    step(clock, "a", "b", tokens=1)  # 30.0 -> 30.125
    assert clock.busy_seconds == 0.375
    assert samples(metrics)[("pdserve:engine_busy_seconds_total", "")] == 0.375

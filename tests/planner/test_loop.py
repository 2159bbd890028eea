"""The planner outside the simulator, without processes: the router's metrics as a Snapshot
(the real `RouterMetrics` exposition), the loop's decisions, actions and metrics on a fake
source and executor, and `SupervisorExecutor` on the supervisor over fake processes."""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from pdserve.planner.actions import DRAIN, FLIP, START, STOP, Action
from pdserve.planner.config import PlannerConfig
from pdserve.planner.loop import PlannerLoop, SupervisorExecutor
from pdserve.planner.policy import Decision, Policy
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView, TtftShares
from pdserve.planner.source import (
    DECODE_WAIT,
    PREFILL_WAIT,
    Measurer,
    NodeLoad,
    Reading,
    node_load,
    p90_of,
    reading_of,
)
from pdserve.router.cluster.timing import TTFT_STAGES, RouterMetrics
from pdserve.supervisor import Supervisor
from tests.pdserve.test_supervisor import _FakeCluster, _Proc

from . import plant

CONFIG = PlannerConfig(ttft_slo=1.0, itl_slo=0.05, interval=5.0, window=20.0, start_timeout=30.0)


class _Stats:
    def stats(self) -> dict[str, float]:
        return {}

    def failovers(self) -> dict[str, int]:
        return {}


def _loads(queued: int = 0) -> tuple[NodeLoad, ...]:
    fields = {"role": DECODE, "draining": False, "num_blocks": 101, "free_blocks": 75,
              "queued_tokens": 0, "prefill_rate": 0.0}  # fmt: skip
    return (NodeLoad("prefill0", PREFILL, False, 0.0, queued, 2000.0), node_load("decode0", fields))


def test_the_router_metrics_become_a_snapshot() -> None:
    metrics = RouterMetrics(_Stats())  # type: ignore[arg-type]
    first = reading_of(0.0, [metrics.exposition().decode()], _loads())
    for _ in range(4):  # four arrive, two of them finish, two are in flight
        metrics.in_flight.inc()
        metrics.prompt_tokens.inc(100)
    for _ in range(2):
        metrics.in_flight.dec()
        metrics.requests.labels(route="/v1/completions", status="200").inc()
    metrics.requests.labels(route="/metrics", status="200").inc(7)  # not a generation
    metrics.generation_tokens.inc(40)
    for ttft in [0.02] * 8 + [3.0, 4.0]:
        metrics.ttft.observe(ttft)
    metrics.itl.observe(0.01)
    for stage, seconds in (("prefill_queue", 6.0), ("decode_reservation", 1.0), ("prefill", 3.0)):
        metrics.ttft_stages.labels(stage).observe(seconds)
    loads = (*_loads(queued=300), NodeLoad("prefill1", PREFILL, False, 0.0, 200, 4000.0))
    second = reading_of(10.0, [metrics.exposition().decode()], loads)
    m = Measurer(itl_slo=0.05, horizon=20.0)
    assert math.isnan(m.snapshot(first, 0.0, ()).arrival_rate)  # no change to measure yet
    snap = m.snapshot(second, 10.0, ())
    assert snap.arrival_rate == pytest.approx(0.4)
    assert (snap.mean_prompt_tokens, snap.mean_output_tokens) == (100.0, 10.0)
    assert snap.queued_prompt_tokens == 500 and snap.prefill_rate == 4000.0  # the best
    assert snap.kv_usage == 0.25  # 25 of the 100 usable blocks (one is the null block)
    assert snap.ttft_p90 == pytest.approx(3.75)  # 9th of 10: half into the (2.5, 5] bucket
    assert snap.itl_p90 == pytest.approx(0.0095)
    assert snap.decode_rate == pytest.approx(4.0 * 0.05 / 0.0095)  # tokens/s x SLO / ITL
    assert snap.ttft_shares == TtftShares(prefill_wait=0.6, decode_wait=0.1)


def test_the_stages_the_planner_reads_are_the_routers() -> None:
    assert {*PREFILL_WAIT, *DECODE_WAIT} <= set(TTFT_STAGES)


def _rates(at: float, **rates: float) -> Reading:
    """A reading of the nodes' prefill rates alone (d*: decode nodes)."""
    loads = tuple(NodeLoad(n, DECODE if n[0] == "d" else PREFILL, False, 0.0, 0, r)
                  for n, r in rates.items())  # fmt: skip
    return Reading(at, 0.0, 0.0, 0.0, 0.0, (), (), loads)


def test_the_prefill_rate_is_the_best_recent_one_not_the_contended_mean() -> None:
    """The planner's real run on two shared cores: p0 alone computes 3,400 tokens/s; three
    prefill nodes at once each measure about half; when the load falls the router prefills
    on d0, whose rate moves, while the idle prefill nodes keep reporting their contended
    rates. Sized by those (1,553 per node in the run), 1,024 tokens/s keeps two nodes."""
    m = Measurer(itl_slo=0.05, horizon=20.0)
    rate = lambda r: m.snapshot(r, r.at, ()).prefill_rate  # noqa: E731
    assert rate(_rates(-10.0, d0=0.0)) is None  # a first reading: nothing to compare yet
    assert rate(_rates(0.0, p0=3400.0, d0=0.0)) == 3400.0
    contended = dict(p0=1700.0, p1=1600.0, p2=1650.0, d0=0.0)
    assert rate(_rates(10.0, **contended)) == 3400.0  # p0's unhindered rate, 10 s old
    assert rate(_rates(31.0, **contended | {"p2": 1620.0})) == 1620.0  # the others aged out
    assert rate(_rates(60.0, **contended | {"p2": 1620.0})) == 1620.0  # nothing moved: held
    assert rate(_rates(70.0, **contended | {"p2": 1620.0, "d0": 3000.0})) == 3000.0
    snap = replace(plant.snapshot(plant.Load(1.0, 1024.0), plant.nodes(3, 1), 70.0),
                   prefill_rate=3000.0, ttft_p90=0.4)  # fmt: skip
    policy = Policy(CONFIG)
    assert policy.decide(snap, 70.0).prefill == 1
    assert Policy(CONFIG).decide(replace(snap, prefill_rate=1553.0), 70.0).prefill == 2


def test_p90_of_a_histogram_between_two_readings() -> None:
    before = ((0.1, 10.0), (1.0, 10.0), (math.inf, 10.0))
    now = ((0.1, 10.0), (1.0, 20.0), (math.inf, 20.0))  # ten new ones, all in (0.1, 1]
    assert p90_of(now, before) == pytest.approx(0.1 + 0.9 * 0.9)
    assert p90_of(before, before) is None  # nothing new
    restarted = ((0.1, 1.0), (1.0, 1.0), (math.inf, 1.0))  # fewer than before: started over
    assert p90_of(restarted, now) == pytest.approx(0.1 * 0.9)


class _Source:
    def __init__(self) -> None:
        self.at, self.answers, self.finished = 0.0, True, 0.0
        self.queued, self.ttft_slow, self.nodes = 0, 0.0, ("prefill0", "decode0")

    def read(self) -> Reading | None:
        if not self.answers:
            return None
        self.at += CONFIG.interval
        ttft = ((0.5, 100.0), (2.0, 100.0), (math.inf, 100.0 + self.ttft_slow))
        loads = tuple(NodeLoad(n, PREFILL if n.startswith("p") else DECODE, False, 0.0,
                               self.queued if n.startswith("p") else 0, 5000.0)
                      for n in self.nodes)  # fmt: skip
        stages = (("prefill", self.at), ("prefill_queue", 2 * self.at))  # waited 2/3 of it
        return Reading(self.at, self.finished, 0.0, self.finished * 100, self.finished * 10,
                       ttft, ((0.01, 5.0), (math.inf, 5.0)), loads, stages)  # fmt: skip


class _Executor:
    """Nodes change at once; a started node is ready when the source lists it."""

    def __init__(self) -> None:
        self.views = {"prefill0": NodeView("prefill0", PREFILL, True, 0.0),
                      "decode0": NodeView("decode0", DECODE, True, 0.0)}  # fmt: skip
        self.applied: list[Action] = []

    def nodes(self, registered: frozenset[str] | None, now: float) -> tuple[NodeView, ...]:
        known = lambda n: registered is None or n.node_id in registered  # noqa: E731
        return tuple(NodeView(n.node_id, n.role, known(n), n.started_at)
                     for n in self.views.values())  # fmt: skip

    def apply(self, decision: Decision, actions: tuple[Action, ...]) -> None:
        for a in actions:
            self.applied.append(a)
            if a.kind == START:
                name = f"{a.role}{len(self.views)}"
                self.views[name] = NodeView(name, a.role, False, decision.at)
            else:
                del self.views[a.node_id]  # type: ignore[arg-type]


def _loop(config: PlannerConfig = CONFIG) -> tuple[PlannerLoop, _Source, _Executor, list[float]]:
    now, source, executor = [0.0], _Source(), _Executor()
    loop = PlannerLoop(config, source, executor, CollectorRegistry(), clock=lambda: now[0])
    return loop, source, executor, now


def _metric(loop: PlannerLoop, name: str, **labels: str) -> float | None:
    return loop.metrics.registry.get_sample_value(name, labels)


def test_a_ttft_breach_with_a_queue_starts_a_prefill_node_and_idle_drains_it(caplog) -> None:
    loop, source, executor, now = _loop()
    caplog.set_level(logging.INFO, "pdserve.planner")
    for t in (0.0, 5.0):  # the first reading has no change to measure: no decision
        now[0] = t
        loop.tick()
    source.finished, source.queued, source.ttft_slow = 10.0, 4000, 50.0
    now[0] = 10.0
    loop.tick()
    assert [(a.kind, a.role) for a in executor.applied] == [(START, PREFILL)]
    assert _metric(loop, "pdserve:planner_target_nodes", role="prefill") == 2
    assert _metric(loop, "pdserve:planner_actions_total", kind=START, role=PREFILL) == 1
    assert _metric(loop, "pdserve:planner_input", figure="queued_prompt_tokens") == 4000
    share = _metric(loop, "pdserve:planner_input", figure="ttft_prefill_wait_share")
    assert share == pytest.approx(2 / 3) and "ttft_prefill_wait_share 0.6667" in caplog.text
    assert "prefill 1->2" in caplog.text and "queued_prompt_tokens 4000" in caplog.text
    now[0] = 12.0
    loop.tick()  # before the interval has passed: nothing
    assert _metric(loop, "pdserve:planner_decisions_total", decided="yes") == 2  # at 5 and 10
    source.nodes += ("prefill2",)  # it registered
    source.queued, source.ttft_slow = 0, 0.0  # idle from now on (no arrival)
    for t in (15.0, 20.0):
        now[0] = t
        loop.tick()
    assert executor.applied[-1] == Action(DRAIN, PREFILL, "prefill2")
    assert sum(v.role == PREFILL for v in executor.views.values()) == CONFIG.min_prefill


def test_no_reading_makes_no_decision_and_no_action() -> None:
    """Not even a stop: without the routers, no node is known to be unregistered."""
    loop, source, executor, now = _loop()
    executor.views["decode9"] = NodeView("decode9", DECODE, False, 0.0)
    source.answers = False
    for t in range(0, 40, 5):
        now[0] = float(t)
        loop.tick()
    assert executor.applied == []
    assert _metric(loop, "pdserve:planner_decisions_total", decided="no") == 8
    assert math.isnan(_metric(loop, "pdserve:planner_input", figure="arrival_rate"))  # type: ignore[arg-type]


def test_a_node_that_never_registers_is_stopped_and_counted() -> None:
    """It is stopped after the start timeout, and a new one asked for at once."""
    loop, source, executor, now = _loop(replace(CONFIG, min_decode=2))
    executor.views["decode9"] = NodeView("decode9", DECODE, False, 0.0)
    for t in range(0, 40, 5):  # the routers answer; decode9 is never among their nodes
        now[0] = float(t)
        loop.tick()
    assert executor.applied == [Action(STOP, DECODE, "decode9"), Action(START, DECODE)]
    assert _metric(loop, "pdserve:planner_nodes_never_ready_total") == 1


class _Signalled(_Proc):
    def __init__(self) -> None:
        super().__init__()
        self.signals: list[int] = []

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


class _Cluster(_FakeCluster):
    def spawn(self, name: str) -> _Signalled:  # type: ignore[override]
        super().spawn(name)
        self.procs[name] = _Signalled()
        return self.procs[name]  # type: ignore[return-value]


def test_the_supervisor_starts_drains_and_flips_nodes() -> None:
    cluster = _Cluster("m", 1, 1, port=1, control_port=2)
    cluster.spawned = []
    cluster.procs = {name: _Signalled() for name in cluster.children()}
    now = [100.0]
    sup = Supervisor(cluster, clock=lambda: now[0])
    executor = SupervisorExecutor(sup)
    executor.apply(_decision(), (Action(START, PREFILL), Action(FLIP, PREFILL, "decode0")))
    assert cluster.spawned == ["prefill1"]
    assert cluster.children()["prefill1"][:2] == ["prefill", "--model"]
    assert cluster.procs["decode0"].signals == [signal.SIGTERM]  # draining, not yet gone
    registered = frozenset({"prefill0", "decode0"})
    assert executor.nodes(registered, now[0]) == (
        NodeView("prefill0", PREFILL, True, 0.0),  # never started here: at 0
        NodeView("decode0", PREFILL, False, 100.0),  # counted in its next role meanwhile
        NodeView("prefill1", PREFILL, False, 100.0),
    )
    cluster.procs["decode0"].returncode = 0  # drained
    sup.poll()
    assert "decode0" not in sup.children and "decode0" not in cluster.children()
    assert cluster.spawned == ["prefill1", "prefill2"] and sup.children["prefill2"].restarts == 0
    executor.apply(_decision(), (Action(DRAIN, PREFILL, "prefill1"),))
    cluster.procs["prefill1"].returncode = -signal.SIGTERM
    sup.poll()  # a drained node is not restarted
    assert sorted(sup.children) == ["prefill0", "prefill2", "router"]


def _decision() -> Decision:
    return Decision(0.0, 1, 1, (), (1, 1))


def _decoded(at: float, answers: float, busy: float) -> Reading:
    """A reading after `answers` answer tokens in all (one ITL each, under 25 ms), of one
    decode node busy `busy` s."""
    node = NodeLoad("d0", DECODE, False, 0.1, 0, 0.0, busy)
    return Reading(at, 0.0, 0.0, 0.0, answers, (), ((0.025, answers), (math.inf, answers)), (node,))


def test_the_decode_rate_is_answer_tokens_per_busy_second_times_the_itl_headroom() -> None:
    """40 answer tokens in 10 s from a node busy 2 of them: 20 tokens per busy second (4 per
    wall second), times SLO / ITL; a node that reports no busy time: per wall second."""
    m = Measurer(itl_slo=0.05, horizon=20.0)
    m.snapshot(_decoded(0.0, 0.0, 5.0), 0.0, ())
    snap = m.snapshot(_decoded(10.0, 40.0, 7.0), 10.0, ())
    assert snap.itl_p90 == pytest.approx(0.0225)  # 36th of 40 in the (0, 25 ms] bucket
    assert snap.decode_rate == pytest.approx(20.0 * 0.05 / 0.0225)
    m = Measurer(itl_slo=0.05, horizon=20.0)
    m.snapshot(_decoded(0.0, 0.0, 0.0), 0.0, ())
    snap = m.snapshot(_decoded(10.0, 40.0, 0.0), 10.0, ())
    assert snap.decode_rate == pytest.approx(4.0 * 0.05 / 0.0225)

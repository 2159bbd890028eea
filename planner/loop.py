"""`PlannerLoop`: the planner outside the simulator. Every `interval` it reads the routers
(`source.RouterSource`), makes the policy's decision on that snapshot, turns it into actions
and hands them to an `Executor`: `SupervisorExecutor` for `pdserve serve` (starts, drains and
flips the supervisor's child processes), `k8s.KubeExecutor` on Kubernetes (sets the replicas
of the prefill and decode Deployments). Every decision is logged with its inputs and exported
as `pdserve:planner_*` metrics.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.planner.actions import DRAIN, FLIP, START, STOP, Action, actions_for
from pdserve.planner.config import PlannerConfig
from pdserve.planner.policy import Decision, Policy
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView, Snapshot
from pdserve.planner.source import Measurer, Reading

if TYPE_CHECKING:
    from pdserve.supervisor import Supervisor

log = logging.getLogger("pdserve.planner")

INPUTS = ("arrival_rate", "mean_prompt_tokens", "mean_output_tokens", "queued_prompt_tokens",
          "kv_usage", "prefill_rate", "decode_rate", "ttft_p90", "itl_p90")  # fmt: skip


class Source(Protocol):
    def read(self) -> Reading | None:
        """The routers' figures now; None when no router answered."""


class Executor(Protocol):
    """Where the planner's decisions take effect."""

    def nodes(self, registered: frozenset[str] | None, now: float) -> tuple[NodeView, ...]:
        """The nodes as the planner counts them; `registered`: the node ids the routers know
        (a node is ready once registered; None: unknown, every node counts as ready)."""

    def apply(self, decision: Decision, actions: tuple[Action, ...]) -> None:
        """Carry out one decision (OSError or RuntimeError: it could not, in part)."""


class PlannerLoop:
    """Decides every `config.interval` seconds of `clock`; `tick()` is called often (the
    supervisor's loop), `step()` is one decision."""

    def __init__(
        self,
        config: PlannerConfig,
        source: Source,
        executor: Executor,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.source = source
        self.executor = executor
        self.policy = Policy(config)
        self.measurer = Measurer(config.itl_slo, config.window)
        self.metrics = PlannerMetrics(registry or CollectorRegistry())
        self.clock = clock
        self._next = clock()

    def tick(self) -> None:
        now = self.clock()
        if now >= self._next:
            self._next = now + self.config.interval
            self.step(now)

    def step(self, now: float) -> Decision:
        reading = self.source.read()
        # No reading: which nodes registered is unknown, and none is taken for never ready.
        registered = None if reading is None else frozenset(n.node_id for n in reading.nodes)
        nodes = self.executor.nodes(registered, now)
        snap = self.measurer.snapshot(reading, now, nodes)
        decision = self.policy.decide(snap, now)
        actions = actions_for(decision, nodes)
        log.info("%s | inputs: %s", decision.describe(), _inputs(snap))
        for action in actions:
            log.info("planner: %s %s %s", action.kind, action.role, action.node_id or "")
        try:
            self.executor.apply(decision, actions)
        except (OSError, RuntimeError) as exc:
            log.error("planner: could not carry out the decision: %s", exc)
            self.metrics.failures.inc()
        self.metrics.observe(decision, actions, snap)
        return decision


def _inputs(snap: Snapshot) -> str:
    return ", ".join(f"{name} {value:.4g}" for name, value in figures(snap).items())


def figures(snap: Snapshot) -> dict[str, float]:
    """The snapshot's figures by name, as logged and exported (NaN: not measured)."""
    out = {name: _number(getattr(snap, name)) for name in INPUTS}
    shares = snap.ttft_shares
    out["ttft_prefill_wait_share"] = shares.prefill_wait if shares else math.nan
    out["ttft_decode_wait_share"] = shares.decode_wait if shares else math.nan
    return out


def _number(value: float | None) -> float:
    return math.nan if value is None else value


class PlannerMetrics:
    """`pdserve:planner_*`: the decisions, the actions, and the inputs of the last decision."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        reg = registry
        self.target = Gauge("pdserve:planner_target_nodes", "Nodes the planner last asked for",
                            ["role"], registry=reg)  # fmt: skip
        self.counted = Gauge("pdserve:planner_nodes", "Nodes the planner counted (not draining)",
                             ["role"], registry=reg)  # fmt: skip
        self.decisions = Counter("pdserve:planner_decisions", "Decisions (no: no decision made)",
                                 ["decided"], registry=reg)  # fmt: skip
        self.actions = Counter("pdserve:planner_actions", "Actions carried out",
                               ["kind", "role"], registry=reg)  # fmt: skip
        self.never_ready = Counter("pdserve:planner_nodes_never_ready",
                                   "Nodes stopped because they were not ready in time",
                                   registry=reg)  # fmt: skip
        self.failures = Counter("pdserve:planner_action_failures",
                                "Decisions whose actions failed in part", registry=reg)  # fmt: skip
        self.inputs = Gauge("pdserve:planner_input", "The last decision's inputs (NaN: none)",
                            ["figure"], registry=reg)  # fmt: skip

    def observe(self, decision: Decision, actions: tuple[Action, ...], snap: Snapshot) -> None:
        self.decisions.labels(decided="yes" if decision.decided else "no").inc()
        for role, now, target in zip((PREFILL, DECODE), decision.current,
                                     (decision.prefill, decision.decode)):  # fmt: skip
            self.counted.labels(role=role).set(now)
            if target is not None:
                self.target.labels(role=role).set(target)
        for action in actions:
            self.actions.labels(kind=action.kind, role=action.role).inc()
        self.never_ready.inc(len(decision.stop))
        for name, value in figures(snap).items():
            self.inputs.labels(figure=name).set(value)


class SupervisorExecutor:
    """`pdserve serve`'s nodes: a start is a new child process; a drain is SIGTERM (the node
    finishes what it holds, then leaves); a flip drains the node and starts one of the other
    role once it has left (counted as that role, not yet ready, meanwhile); a stop kills a
    node that was never ready."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def nodes(self, registered: frozenset[str] | None, now: float) -> tuple[NodeView, ...]:
        out = []
        roles = self.supervisor.cluster.children()
        for name, child in self.supervisor.children.items():
            role = roles.get(name, [""])[0]
            if role not in (PREFILL, DECODE):
                continue  # a router
            if child.retiring and child.then is not None:
                out.append(NodeView(name, child.then, False, child.retired_at))
            else:
                ready = (registered is None or name in registered) and not child.retiring
                out.append(NodeView(name, role, ready, child.started_at, child.retiring))
        return tuple(out)

    def apply(self, decision: Decision, actions: tuple[Action, ...]) -> None:
        sup = self.supervisor
        for action in actions:
            if action.kind == START:
                sup.start_node(action.role)
            elif action.kind == DRAIN:
                sup.retire(action.node_id)  # type: ignore[arg-type]
            elif action.kind == FLIP:
                sup.retire(action.node_id, then=action.role)  # type: ignore[arg-type]
            elif action.kind == STOP:
                sup.retire(action.node_id, at_once=True)  # type: ignore[arg-type]

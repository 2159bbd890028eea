"""A discrete-event model of a P/D deployment, driven by a trace, sized either statically or by
the planner's `Policy` (the same object `pdserve serve --planner` runs).

The model: a router queue (FIFO); a request leaves it when a prefill node is idle and a decode
node can reserve its prompt and answer tokens of KV (pdserve's order: decode reserves first).
A prefill node computes one prompt at a time at `prefill_rate` tokens/s; the KV then moves at
`transfer_rate`; a decode node runs its sequences in one batch whose step takes `step_base`
plus a share per sequence and per thousand context tokens (continuous batching). A started
node serves after `start_delay`; a drained one leaves when empty; a flipped one drains, then
serves in its new role after `flip_delay`. The rates are `NodeModel`'s, assumed unless given.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.planner.actions import DRAIN, FLIP, START, STOP, Action, actions_for
from pdserve.planner.policy import Decision, Policy
from pdserve.planner.snapshot import DECODE, PREFILL, NodeView, Snapshot
from pdserve.planner.window import Window, p90


@dataclass(frozen=True, slots=True)
class NodeModel:
    """One node's speed and size (defaults: assumed, of the order of an 8B model on one
    accelerator; not calibrated from a pdserve run)."""

    prefill_rate: float = 8000.0  # prompt tokens per second
    prefill_overhead: float = 0.01  # seconds per prompt
    transfer_rate: float = 200_000.0  # KV tokens per second, prefill -> decode
    step_base: float = 0.012  # a decode step's fixed cost (s)
    step_per_seq: float = 0.0004  # and per running sequence
    step_per_ktok: float = 0.00002  # and per thousand context tokens in the batch
    kv_tokens: int = 400_000  # one decode node's KV
    start_delay: float = 60.0
    flip_delay: float = 10.0

    def step(self, batch: int, context: float) -> float:
        return self.step_base + self.step_per_seq * batch + self.step_per_ktok * context / 1000

    def decode_rate(self, context: float, itl_slo: float) -> float:
        """Answer tokens per second one decode node sustains with every step within the ITL
        SLO, at sequences of `context` tokens."""
        batch = (itl_slo - self.step_base) / (
            self.step_per_seq + self.step_per_ktok * context / 1000
        )
        return max(batch, 0.0) / itl_slo


@dataclass(slots=True, eq=False)
class Request:
    at: float
    prompt: int
    output: int
    ttft: float | None = None
    decode_time: float = 0.0
    left: float = 0.0  # answer tokens still to decode
    done: bool = False

    def tpot(self) -> float:
        return self.decode_time / (self.output - 1) if self.output > 1 else 0.0


@dataclass(slots=True, eq=False)
class Node:
    node_id: str
    role: str
    started_at: float
    ready: bool = False
    draining: bool = False
    flip_to: str | None = None
    gone_at: float | None = None
    busy: Request | None = None  # prefill: the prompt being computed
    batch: list[Request] = field(default_factory=list)  # decode: the running sequences
    reserved: int = 0  # decode: KV tokens held by its batch and by transfers on their way
    last: float = 0.0
    version: int = 0  # decode: the completion event scheduled last

    def view(self) -> NodeView:
        return NodeView(self.node_id, self.role, self.ready, self.started_at, self.draining)

    def idle(self) -> bool:
        return self.busy is None and not self.batch and self.reserved == 0


class Sim:
    """One run: `Sim(trace, model, slos, nodes=(p, d), policy=...).run()`. Without a policy
    the counts stay as given."""

    def __init__(
        self,
        trace: Sequence[Any],
        model: NodeModel,
        slos: tuple[float, float],
        nodes: tuple[int, int],
        policy: Policy | None = None,
        never_ready: Callable[[int], bool] = lambda i: False,
    ) -> None:
        self.model, self.slos, self.policy, self.never_ready = model, slos, policy, never_ready
        self.requests = [Request(r.at, r.input_len, r.output_len) for r in trace]
        self.now, self.queue, self.nodes = 0.0, deque[Request](), list[Node]()
        self.window, self.decisions = Window(), list[Decision]()
        self._seen_context = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq, self._ids, self._done = itertools.count(), itertools.count(), 0
        for role, n in ((PREFILL, nodes[0]), (DECODE, nodes[1])):
            for _ in range(n):
                self._add(role).ready = True

    def run(self) -> SimResult:
        for r in self.requests:
            self._at(r.at, self._arrive, r)
        if self.policy:
            self._at(self.policy.config.interval, self._plan)
        while self._events and self._done < len(self.requests):
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return SimResult.of(self)

    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def _add(self, role: str) -> Node:
        node = Node(f"{role[0]}{next(self._ids)}", role, self.now, last=self.now)
        self.nodes.append(node)
        return node

    def _live(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role and n.ready and not n.draining]

    # --- the request path --------------------------------------------------------------

    def _arrive(self, r: Request) -> None:
        self.window.arrived(r.prompt, r.output)
        self.queue.append(r)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.queue:
            r = self.queue[0]
            prefill = next((n for n in self._live(PREFILL) if n.busy is None), None)
            decode = [
                n
                for n in self._live(DECODE)
                if n.reserved + r.prompt + r.output <= self.model.kv_tokens
            ]
            if prefill is None or not decode:
                return
            self.queue.popleft()
            target = min(decode, key=lambda n: n.reserved)
            target.reserved += r.prompt + r.output
            prefill.busy = r
            took = self.model.prefill_overhead + r.prompt / self.model.prefill_rate
            self._at(self.now + took, self._prefilled, prefill, target, r, took)

    def _prefilled(self, node: Node, dest: Node, r: Request, took: float) -> None:
        r.ttft = self.now - r.at
        self.window.prefilled(r.prompt, took, r.ttft)
        node.busy = None
        self._at(self.now + r.prompt / self.model.transfer_rate, self._admit, dest, r)
        self._retire_if_done(node)
        self._dispatch()

    def _admit(self, node: Node, r: Request) -> None:
        self._advance(node)
        r.left = r.output - 1
        node.batch.append(r)
        self._finish_decoded(node)

    def _advance(self, node: Node) -> None:
        """Every running sequence gains the steps since the node's last event."""
        dt = self.now - node.last
        if node.batch and dt > 0:
            steps = dt / self.model.step(len(node.batch), self._context(node))
            for r in node.batch:
                r.left -= steps
                r.decode_time += dt
        node.last = self.now

    def _context(self, node: Node) -> float:
        return sum(r.prompt + r.output - r.left for r in node.batch)

    def _decoded(self, node: Node, version: int) -> None:
        if version == node.version:
            self._advance(node)
            self._finish_decoded(node)

    def _finish_decoded(self, node: Node) -> None:
        for r in [r for r in node.batch if r.left <= 1e-9]:
            node.batch.remove(r)
            node.reserved -= r.prompt + r.output
            r.done = True
            self._done += 1
            self.window.finished(r.tpot() if r.output > 1 else None)
        node.version += 1
        if node.batch:
            step = self.model.step(len(node.batch), self._context(node))
            soonest = min(r.left for r in node.batch)
            self._at(self.now + soonest * step, self._decoded, node, node.version)
        self._retire_if_done(node)
        self._dispatch()

    # --- the planner and the nodes' lives ------------------------------------------------

    def _plan(self) -> None:
        assert self.policy is not None
        decision = self.policy.decide(self.snapshot(), self.now)
        self.decisions.append(decision)
        for action in actions_for(decision, tuple(n.view() for n in self._present())):
            self._apply(action)
        self._dispatch()
        self._at(self.now + self.policy.config.interval, self._plan)

    def _present(self) -> list[Node]:
        return [n for n in self.nodes if n.gone_at is None]

    def snapshot(self) -> Snapshot:
        """The figures of the last interval, as the router would measure them."""
        config = self.policy.config if self.policy else None
        interval = config.interval if config else 10.0
        queued = sum(r.prompt for r in self.queue)
        queued += sum(n.busy.prompt for n in self._present() if n.busy)  # not yet computed
        decode = self._live(DECODE)
        kv = (
            sum(n.reserved for n in decode) / (self.model.kv_tokens * len(decode))
            if decode
            else 0.0
        )
        figures = self.window.close(interval)
        if figures.arrival_rate:  # the decode rate at the sequences last seen arriving
            self._seen_context = figures.mean_prompt + figures.mean_output / 2
        seen = self._seen_context
        rate = self.model.decode_rate(seen, self.slos[1]) if seen else None
        views = tuple(n.view() for n in self._present())
        return Snapshot(
            self.now,
            figures.arrival_rate,
            figures.mean_prompt,
            figures.mean_output,
            queued,
            min(kv, 1.0),
            figures.prefill_rate,
            rate,
            figures.ttft_p90,
            figures.itl_p90,
            views,
        )

    def _apply(self, action: Action) -> None:
        if action.kind == START:
            node = self._add(action.role)
            if not self.never_ready(int(node.node_id[1:])):
                self._at(self.now + self.model.start_delay, self._ready, node)
            return
        node = next(n for n in self.nodes if n.node_id == action.node_id)
        if action.kind == STOP:
            node.gone_at = self.now
        elif action.kind in (DRAIN, FLIP):
            node.draining = True
            node.flip_to = action.role if action.kind == FLIP else None
            self._retire_if_done(node)

    def _ready(self, node: Node) -> None:
        if node.gone_at is None and not node.draining:
            node.ready = True
            self._dispatch()

    def _retire_if_done(self, node: Node) -> None:
        if not (node.draining and node.idle()) or node.gone_at is not None:
            return
        if node.flip_to is None:
            node.gone_at = self.now
            return
        node.role, node.flip_to, node.draining, node.ready = node.flip_to, None, False, False
        self._at(self.now + self.model.flip_delay, self._ready, node)


@dataclass(frozen=True, slots=True)
class SimResult:
    """Goodput (the share of requests within both SLOs: TTFT and mean ITL), node-seconds up to
    the last answer, and the decisions made."""

    goodput: float
    node_seconds: float
    end: float
    ttft_p90: float
    tpot_p90: float
    decisions: tuple[Decision, ...]

    @classmethod
    def of(cls, sim: Sim) -> SimResult:
        ttft_slo, itl_slo = sim.slos
        good = sum(r.done and r.ttft <= ttft_slo and r.tpot() <= itl_slo for r in sim.requests)  # type: ignore[operator]
        seconds = sum(
            (n.gone_at if n.gone_at is not None else sim.now) - n.started_at for n in sim.nodes
        )
        ttfts = sorted(r.ttft for r in sim.requests if r.ttft is not None)
        tpots = sorted(r.tpot() for r in sim.requests if r.done)
        return cls(
            good / len(sim.requests),
            seconds,
            sim.now,
            _p90(ttfts),
            _p90(tpots),
            tuple(sim.decisions),
        )


def _p90(values: list[float]) -> float:
    found = p90(values)
    return float("nan") if found is None else found

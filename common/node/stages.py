"""When each request reached each stage on this node, and the spans of those stages.

Every node times every request (a few monotonic readings; the router's TTFT histograms need
them whether or not anything is traced) and hands the durations to the router with the first
token it computes (`Tokens.stages`). A request whose router sent a traceparent also gets its
stages as spans under the router's request span; with tracing off (`tracer` None) none is made.

A prompt computed here: taken -> queue -> first step that ran it -> prefill -> first token.
A prompt whose KV a prefill node sends (a decode node's reservation): reserved -> KV transfer
-> KV whole -> admission -> first step -> its first token.

The node's span of a traced request's computing (`prefill`, or a decode node's
`decode.first_step`) is open while its steps run: the other ranks of a tensor-parallel node
put their own spans of those steps under it (`step_started` gives their parents).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.common.engine.model_runner import LayerCall
from pdserve.common.engine.scheduler import SchedulerOutput
from pdserve.common.node.metrics import NodeMetrics
from pdserve.common.tracing import REQUEST_ID, TIME_IN_PREFILL, TIME_IN_QUEUE, Tracer
from pdserve.common.wire.messages import Tokens
from pdserve.common.wire.payloads import StageTimes


@dataclass(slots=True)
class _Stamps:
    """One request's readings of the monotonic clock (0: not yet)."""

    taken: float
    traceparent: str | None
    remote: bool  # its KV comes from a prefill node
    kv_whole: float = 0.0
    scheduled: float = 0.0
    handoff: bool = False  # a prefill node's: kept until its KV is all sent
    first: float = 0.0
    chunks: list[tuple[float, float, int]] = field(default_factory=list)  # traced only
    span: Any = None  # the node's open span of the request's steps (traced only)
    ranks_parent: str = ""  # its traceparent, for the other ranks' spans


class StageClock:
    """The stages of the requests this node holds, by request id. The node calls it where a
    stage ends; a request it forgets (aborted, handed off) leaves nothing behind."""

    def __init__(
        self, tracer: Tracer | None, node_id: str, metrics: NodeMetrics | None = None
    ) -> None:
        self.tracer = tracer
        self.node_id = node_id
        self.metrics = metrics  # the node's request histograms, observed as stages end
        self._stamps: dict[str, _Stamps] = {}
        self._step: list[tuple[_Stamps, int]] = []  # traced requests of the running step
        self._step_start = 0.0

    def __len__(self) -> int:
        return len(self._stamps)

    def taken(self, request_id: str, traceparent: str | None, remote: bool = False) -> None:
        """The node took the request (queued it, or reserved its blocks: `remote`)."""
        parent = traceparent if self.tracer is not None else None
        stamps = self._stamps[request_id] = _Stamps(time.monotonic(), parent, remote)
        if parent is not None and not remote:
            self._open("prefill", stamps, stamps.taken, request_id)

    def reserved(self, request_id: str, blocks: int, cached_tokens: int) -> None:
        """A decode node reserved the request's blocks (a traced request: its span)."""
        stamps = self._stamps.get(request_id)
        if stamps is not None and stamps.traceparent is not None:
            attrs = {REQUEST_ID: request_id, "pdserve.blocks": blocks}
            attrs["pdserve.cached_tokens"] = cached_tokens
            self._span("decode.reserve", stamps, stamps.taken, time.monotonic(), attrs)

    def hand_off_later(self, request_id: str) -> None:
        """Keep the request past its first token: its KV goes out after it (`kv_sent`)."""
        stamps = self._stamps.get(request_id)
        if stamps is not None:
            stamps.handoff = True

    def kv_whole(self, request_id: str, ok: bool, pages: int, connector: str) -> None:
        """Every rank holds the request's KV (or a slice failed: `ok` False)."""
        stamps = self._stamps.get(request_id)
        if stamps is None:
            return
        stamps.kv_whole = time.monotonic()
        if self.metrics is not None:
            self.metrics.kv_received(stamps.kv_whole - stamps.taken, pages, ok)
        if stamps.traceparent is not None:
            attrs = {REQUEST_ID: request_id, "pdserve.kv.connector": connector}
            attrs |= {"pdserve.kv.pages": pages, "pdserve.kv.checksum_ok": ok}
            self._span("decode.kv_transfer", stamps, stamps.taken, stamps.kv_whole, attrs)
        if not ok:  # the request fails here: no first token will come
            self.forget(request_id)

    def step_started(self, output: SchedulerOutput) -> tuple[str, ...]:
        """A step runs these requests: the first step of each ends its queue (or admission).
        The node spans the other ranks' spans of this step go under (none: nothing traced)."""
        now = self._step_start = time.monotonic()
        parents: list[str] = []
        for seq in output.seqs:
            stamps = self._stamps.get(seq.request_id)
            if stamps is None:
                continue
            if not stamps.scheduled:
                stamps.scheduled = now
            if stamps.traceparent is not None and not stamps.first:
                if stamps.span is None:  # a decode node's first step
                    self._open("decode.first_step", stamps, now, seq.request_id)
                self._step.append((stamps, len(seq.token_ids)))
                parents.append(stamps.ranks_parent)
        return tuple(parents)

    def step_call(self, output: SchedulerOutput) -> LayerCall | None:
        """`step_started` as a step's layer call: nothing to run, the node spans for the other
        tensor-parallel ranks (None: nothing traced)."""
        return LayerCall.traced(None, self.step_started(output))

    def step_done(self) -> None:
        """The step ended: each traced request's part of it is one chunk."""
        now = time.monotonic()
        for stamps, tokens in self._step:
            stamps.chunks.append((self._step_start, now, tokens))
        self._step.clear()

    def first_token(self, msg: Tokens) -> Tokens:
        """`msg` with the request's stages when it carries the first token computed here;
        as it is otherwise (one dictionary miss per message)."""
        stamps = self._stamps.get(msg.request_id)
        if stamps is None or stamps.first or not msg.token_ids:
            if stamps is not None and msg.finish_reason and not stamps.handoff:
                self.forget(msg.request_id)  # a prompt only scored: no token comes
            return msg
        stamps.first = time.monotonic()
        stages = self._stages(stamps)
        if self.metrics is not None:
            self.metrics.first_token(stages, stamps.remote)
        if stamps.traceparent is not None:
            self._spans(msg.request_id, stamps, stages)
        if not stamps.handoff:
            del self._stamps[msg.request_id]
        return replace(msg, stages=stages)

    def kv_sent(self, request_id: str, pages: int, connector: str, ok: bool) -> None:
        """A prefill node sent the request's last KV and its done message: forget it."""
        stamps = self._stamps.pop(request_id, None)
        if stamps is None or stamps.traceparent is None:
            return
        attrs = {REQUEST_ID: request_id, "pdserve.kv.connector": connector}
        attrs |= {"pdserve.kv.pages": pages, "pdserve.kv.sent": ok}
        start = stamps.scheduled or stamps.taken
        self._span("prefill.kv_send", stamps, start, time.monotonic(), attrs)

    def lease_expired(self, request_id: str, lease_timeout: float) -> None:
        """The request's router stopped renewing its lease: a traced request gets a span from
        its taking to now, and a node span still open ends with that outcome."""
        stamps = self._stamps.get(request_id)
        if stamps is not None and stamps.traceparent is not None:
            attrs = {REQUEST_ID: request_id, "pdserve.lease_timeout": lease_timeout}
            self._span("node.lease_expired", stamps, stamps.taken, time.monotonic(), attrs)
        self.forget(request_id, "lease_expired")

    def forget(self, request_id: str, outcome: str = "ended") -> None:
        """The request ended here before its first token (aborted, failed): no stage of it
        is reported; a node span still open ends now."""
        stamps = self._stamps.pop(request_id, None)
        if stamps is not None and stamps.span is not None:
            assert self.tracer is not None
            self.tracer.end(stamps.span, time.monotonic(), {"pdserve.outcome": outcome})

    # -- stages and spans ----------------------------------------------------------------

    @staticmethod
    def _stages(s: _Stamps) -> StageTimes:
        if s.remote:
            admitted = s.kv_whole or s.scheduled
            return StageTimes(
                kv_transfer=admitted - s.taken,
                admission=s.scheduled - admitted,
                first_step=s.first - s.scheduled,
            )
        return StageTimes(queue=s.scheduled - s.taken, prefill=s.first - s.scheduled)

    def _open(self, name: str, s: _Stamps, start: float, request_id: str) -> None:
        """Open the node's span of the request's steps (ended with its first token)."""
        assert self.tracer is not None, "a traced request on a node without tracer"
        attrs = {REQUEST_ID: request_id, "pdserve.node_id": self.node_id}
        s.span = self.tracer.start(name, s.traceparent, start, attrs)
        s.ranks_parent = self.tracer.traceparent(s.span) or ""

    def _close(self, s: _Stamps, attrs: dict) -> Any:
        """End the open span with the first token: the span, to parent others under it."""
        assert self.tracer is not None and s.span is not None
        span, s.span = s.span, None
        self.tracer.end(span, s.first, attrs)
        return span

    def _span(self, name: str, s: _Stamps, start: float, end: float, attrs: dict) -> object:
        assert self.tracer is not None, "a traced request on a node without tracer"
        attrs["pdserve.node_id"] = self.node_id
        return self.tracer.span(name, s.traceparent, start, end, attrs)

    def _spans(self, rid: str, s: _Stamps, stages: StageTimes) -> None:
        """A traced request's stages up to its first token, as spans under the router's."""
        base = {REQUEST_ID: rid}
        if s.remote:
            self._span("decode.admission", s, s.kv_whole or s.scheduled, s.scheduled, dict(base))
            self._close(s, {})  # decode.first_step
            return
        times = {TIME_IN_QUEUE: stages.queue, TIME_IN_PREFILL: stages.prefill}
        prefill = self._close(s, times)
        assert self.tracer is not None
        self.tracer.span("prefill.queue", prefill, s.taken, s.scheduled, dict(base))
        for i, (begin, end, tokens) in enumerate(s.chunks):
            attrs = base | {"pdserve.chunk": i, "pdserve.chunk.tokens": tokens}
            self.tracer.span("prefill.chunk", prefill, begin, end, attrs)

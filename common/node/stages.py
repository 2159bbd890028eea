"""When each request reached each stage on this node, and the spans of those stages.

Every node times every request (a few monotonic readings; the router's TTFT histograms need
them whether or not anything is traced) and hands the durations to the router with the first
token it computes (`Tokens.stages`). A request whose router sent a traceparent also gets its
stages as spans under the router's request span; with tracing off (`tracer` None) none is made.

A prompt computed here: taken -> queue -> first step that ran it -> prefill -> first token.
A prompt whose KV a prefill node sends (a decode node's reservation): reserved -> KV transfer
-> KV whole -> admission -> first step -> its first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

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
        self._stamps[request_id] = _Stamps(time.monotonic(), parent, remote)

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
            del self._stamps[request_id]

    def step_started(self, output: SchedulerOutput) -> None:
        """A step runs these requests: the first step of each ends its queue (or admission)."""
        now = self._step_start = time.monotonic()
        for seq in output.seqs:
            stamps = self._stamps.get(seq.request_id)
            if stamps is None:
                continue
            if not stamps.scheduled:
                stamps.scheduled = now
            if stamps.traceparent is not None and not stamps.first:
                self._step.append((stamps, len(seq.token_ids)))

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
                del self._stamps[msg.request_id]  # a prompt only scored: no token comes
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

    def forget(self, request_id: str) -> None:
        self._stamps.pop(request_id, None)

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

    def _span(self, name: str, s: _Stamps, start: float, end: float, attrs: dict) -> object:
        assert self.tracer is not None, "a traced request on a node without tracer"
        attrs["pdserve.node_id"] = self.node_id
        return self.tracer.span(name, s.traceparent, start, end, attrs)

    def _spans(self, rid: str, s: _Stamps, stages: StageTimes) -> None:
        """A traced request's stages up to its first token, as spans under the router's."""
        base = {REQUEST_ID: rid}
        if s.remote:
            self._span("decode.admission", s, s.kv_whole or s.scheduled, s.scheduled, dict(base))
            self._span("decode.first_step", s, s.scheduled, s.first, dict(base))
            return
        times = {TIME_IN_QUEUE: stages.queue, TIME_IN_PREFILL: stages.prefill}
        prefill = self._span("prefill", s, s.taken, s.first, base | times)
        assert self.tracer is not None
        self.tracer.span("prefill.queue", prefill, s.taken, s.scheduled, dict(base))
        for i, (begin, end, tokens) in enumerate(s.chunks):
            attrs = base | {"pdserve.chunk": i, "pdserve.chunk.tokens": tokens}
            self.tracer.span("prefill.chunk", prefill, begin, end, attrs)

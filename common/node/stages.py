"""What a node measures of each request: its stages, their spans, and its request metrics.

Every node times every request (a few monotonic readings; the router's TTFT histograms need
them whether or not anything is traced) and hands the durations to the router with the first
token it computes (`Tokens.stages`). A request whose router sent a traceparent also gets its
stages as spans under the router's request span; with tracing off (`tracer` None) none is made.
The same stages feed the node's Prometheus histograms (`NodeMetrics`, in vLLM's names).

A prompt computed here: taken -> queue -> first step that ran it -> prefill -> first token.
A prompt whose KV a prefill node sends (a decode node's reservation): reserved -> KV transfer
-> KV whole -> admission -> first step -> its first token.

Only the loop (common/node/loop.py) calls the clock: a role reports the stages it ends with
what it returns (a decode node's `Reserved`) or yields (`KVWhole`, `KVSent`, beside the
messages it sends), and `record` takes them out of the node's outgoing messages.

The node's span of a traced request's computing (`prefill`, or a decode node's
`decode.first_step`) is open while its steps run: the other ranks of a tensor-parallel node
put their own spans of those steps under it (`step_started` gives their parents). A prefix the
engine loaded (in part) from a tier below its pool is one more span under it (`node.tier_load`).

On a node that speculates a traced request is kept past its first token: when it ends
(finished, aborted, its lease lapsed) its drafts are one span (`decode.speculation`), from
the engine's own counts for that request (`Drafter.by_request`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.common.engine.drafting import SpecDecodeStats
from pdserve.common.engine.kv_cache_manager import TierLoads
from pdserve.common.engine.scheduler import SchedulerOutput
from pdserve.common.node.tier_metrics import TierCollector, tier_label
from pdserve.common.tracing import REQUEST_ID, TIME_IN_PREFILL, TIME_IN_QUEUE, Tracer
from pdserve.common.wire.messages import Admitted, Error, Tokens
from pdserve.common.wire.payloads import StageTimes

# Request times from 1 ms (a tiny model's prefill on a CPU) to 10 min (a long prompt queued).
SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
# KV bytes of one request: 4 KiB (a tiny model's block) to 16 GiB, by powers of 4.
BYTES = tuple(float(4**i) for i in range(6, 18))
_NONE: Mapping[str, Any] = {}


# attribute, kind, name, labelled by connector, buckets, help
_SERIES = (
    ("queue_time", Histogram, "pdserve:request_queue_time_seconds", False, SECONDS,
     "Taken by the node to the first step that ran it (a decode node: KV whole to it)"),
    ("prefill_time", Histogram, "pdserve:request_prefill_time_seconds", False, SECONDS,
     "The first step that ran the prompt to its first token (every chunk)"),
    ("kv_time", Histogram, "pdserve:kv_transfer_time_seconds", True, SECONDS,
     "One request's KV transfer on its decode node: blocks reserved to KV whole on every rank "
     "(pages stream as the prefill's layers finish: it overlaps the prefill)"),
    ("kv_bytes", Histogram, "pdserve:kv_transfer_bytes", True, BYTES,
     "KV bytes one request's transfer wrote into its decode node"),
    ("kv_failed", Counter, "pdserve:kv_transfer_failures", True, None,
     "Requests whose KV transfer failed (damaged or missing slices, a broken connection)"),
    ("leases_expired", Counter, "pdserve:lease_expirations", False, None,
     "Requests freed because their router stopped renewing their lease"),
    ("busy", Counter, "pdserve:engine_busy_seconds", False, None,
     "Seconds spent in engine steps that ran work (tokens per busy second: a node's capacity)"),
)  # fmt: skip


class NodeMetrics:
    """The request-level metrics of one node process (rank 0 of a tensor-parallel group): one
    series of each metric in `_SERIES`, under the node's labels (`role`, `node_id`: one query
    sums them across nodes or splits them by role). The clock observes them as stages end; the
    health endpoint serves them (`health.HealthServer`). prometheus_client's metrics lock their
    own values, so the loop's thread writes and the health thread reads without a lock here."""

    queue_time: Any
    prefill_time: Any
    kv_time: Any
    kv_bytes: Any
    kv_failed: Any
    leases_expired: Any
    busy: Any

    def __init__(self, labels: dict[str, str], connector: str = "", block_bytes: int = 0) -> None:
        """`connector`: the node's KV connector ("" for a node that moves no KV: "none");
        `block_bytes`: one block's KV across every layer and head (`KVLayout.block_bytes`).
        Every series exists from the start: a scrape before the first event reads 0."""
        self.registry = CollectorRegistry()
        self.connector = connector
        self._block_bytes = block_bytes
        kv = labels | {"connector": connector or "none"}
        for attr, kind, name, by_connector, buckets, text in _SERIES:
            own = kv if by_connector else labels
            opts = {"buckets": buckets} if buckets else {}
            metric = kind(name, text, list(own), registry=self.registry, **opts)
            setattr(self, attr, metric.labels(**own))
        self.tiers = TierCollector(labels)  # the loop publishes the engine's KV tier counters
        self.registry.register(self.tiers)

    def first_token(self, stages: StageTimes, remote: bool) -> None:
        """A request's stages up to the first token this node computed (`remote`: its KV came
        from a prefill node; its queue is the wait for admission)."""
        if remote:
            self.queue_time.observe(stages.admission)
            return
        self.queue_time.observe(stages.queue)
        self.prefill_time.observe(stages.prefill)

    def kv_received(self, seconds: float, pages: int, ok: bool) -> None:
        """A request's KV transfer of `pages` blocks ended on every rank of this decode node."""
        if not ok:
            self.transfer_failed()
            return
        self.kv_time.observe(seconds)
        self.kv_bytes.observe(self.bytes_of(pages))

    def bytes_of(self, pages: int) -> int:
        """The KV bytes of `pages` blocks (every layer and rank)."""
        return pages * self._block_bytes

    def transfer_failed(self) -> None:
        self.kv_failed.inc()

    def lease_expired(self) -> None:
        self.leases_expired.inc()


@dataclass(frozen=True, slots=True)
class KVWhole:
    """A decode node's stage event: every rank holds the request's KV (`ok` False: a slice
    was not whole, and the request fails here) of `pages` blocks."""

    request_id: str
    ok: bool
    pages: int


@dataclass(frozen=True, slots=True)
class KVSent:
    """A prefill node's stage event: the request's last KV and its done message left (`ok`
    False: its transfer failed), `pages` blocks of it."""

    request_id: str
    pages: int
    ok: bool


# What a role's step and I/O yield: messages to tell each request's router, and the stage
# events the loop records (`StageClock.record`) instead of sending.
Told = Tokens | Error | Admitted | KVWhole | KVSent


@dataclass(slots=True)
class _Stamps:
    """One request's readings of the monotonic clock (0: not yet)."""

    taken: float
    traceparent: str | None
    remote: bool  # its KV comes from a prefill node
    handoff: bool  # a prefill node's: kept until its KV is all sent
    kv_whole: float = 0.0
    scheduled: float = 0.0
    first: float = 0.0
    chunks: list[tuple[float, float, int]] = field(default_factory=list)  # traced only
    span: Any = None  # the node's open span of the request's steps (traced only)
    ranks_parent: str = ""  # its traceparent, for the other ranks' spans
    spec: SpecDecodeStats | None = None  # its drafts' counts, once it drafted (traced only)


class StageClock:
    """The stages of the requests this node holds, by request id. The loop calls it where a
    stage ends; a request it forgets (aborted, handed off) leaves nothing behind."""

    def __init__(
        self,
        tracer: Tracer | None,
        node_id: str,
        metrics: NodeMetrics | None = None,
        spec_method: str = "",
    ) -> None:
        """`spec_method`: the node's speculative method ("" none): a traced request is then
        kept to its end, for its `decode.speculation` span."""
        self.tracer = tracer
        self.node_id = node_id
        self.spec_method = spec_method
        self.metrics = metrics  # the node's request histograms, observed as stages end
        self.connector = metrics.connector if metrics is not None else ""
        self._stamps: dict[str, _Stamps] = {}
        self._step: list[tuple[_Stamps, int]] = []  # traced requests of the running step
        self._step_start = 0.0
        self._step_works = False  # the running step runs a sequence
        self.busy_seconds = 0.0  # in steps that ran work since the node started

    def __len__(self) -> int:
        return len(self._stamps)

    def taken(
        self, request_id: str, traceparent: str | None, remote: bool = False, handoff: bool = False
    ) -> None:
        """The node took the request (queued it, or reserved its blocks: `remote`); one it
        hands off (`handoff`, a prefill node's) is kept past its first token: its KV goes out
        after it (`kv_sent`)."""
        parent = traceparent if self.tracer is not None else None
        stamps = self._stamps[request_id] = _Stamps(time.monotonic(), parent, remote, handoff)
        if parent is not None and not remote:
            self._open("prefill", stamps, stamps.taken, request_id)

    def reserved(self, request_id: str, blocks: int, cached_tokens: int) -> None:
        """A decode node reserved the request's blocks (a traced request: its span)."""
        stamps = self._stamps.get(request_id)
        if stamps is not None and stamps.traceparent is not None:
            attrs = {REQUEST_ID: request_id, "pdserve.blocks": blocks}
            attrs["pdserve.cached_tokens"] = cached_tokens
            self._span("decode.reserve", stamps, stamps.taken, time.monotonic(), attrs)

    def record(self, msg: Told) -> Tokens | Error | Admitted | None:
        """What the node sends of a role's message: a stage event is recorded and goes no
        further (None), a first token gets the request's stages, anything else is as it was."""
        if isinstance(msg, KVWhole):
            return self.kv_whole(msg.request_id, msg.ok, msg.pages)
        if isinstance(msg, KVSent):
            return self.kv_sent(msg.request_id, msg.pages, msg.ok)
        return self.first_token(msg) if isinstance(msg, Tokens) else msg

    def kv_whole(self, request_id: str, ok: bool, pages: int) -> None:
        """Every rank holds the request's KV (or a slice failed: `ok` False)."""
        stamps = self._stamps.get(request_id)
        if stamps is None:
            return
        stamps.kv_whole = time.monotonic()
        if self.metrics is not None:
            self.metrics.kv_received(stamps.kv_whole - stamps.taken, pages, ok)
        if stamps.traceparent is not None:
            attrs = {REQUEST_ID: request_id, "pdserve.kv.connector": self.connector}
            attrs |= {"pdserve.kv.pages": pages, "pdserve.kv.checksum_ok": ok}
            if self.metrics is not None:
                attrs["pdserve.kv.bytes"] = self.metrics.bytes_of(pages)
            self._span("decode.kv_transfer", stamps, stamps.taken, stamps.kv_whole, attrs)
        if not ok:  # the request fails here: no first token will come
            self.forget(request_id)

    def step_started(
        self,
        output: SchedulerOutput,
        tier_loads: Mapping[str, TierLoads] = _NONE,
        drafts: Mapping[str, SpecDecodeStats] = _NONE,
    ) -> tuple[str, ...]:
        """A step runs these requests: the first step of each ends its queue (or admission).
        The node spans the other ranks' spans of this step go under (none: nothing traced).
        `tier_loads` and `drafts`: the engine's per-request records (`KVCacheManager.
        req_tier_loads`, `Drafter.by_request`), read for traced requests only."""
        now = self._step_start = time.monotonic()
        self._step_works = bool(output.seqs)
        parents: list[str] = []
        for seq in output.seqs:
            stamps = self._stamps.get(seq.request_id)
            if stamps is None:
                continue
            first_step = not stamps.scheduled
            if first_step:
                stamps.scheduled = now
            if stamps.traceparent is None:
                continue
            if stamps.first:  # decoding past its first token: kept for its drafts' span
                if seq.num_drafts and stamps.spec is None:
                    stamps.spec = drafts.get(seq.request_id)
                continue
            if stamps.span is None:  # a decode node's first step
                self._open("decode.first_step", stamps, now, seq.request_id)
            if first_step and seq.request_id in tier_loads:
                self._tier_span(seq.request_id, stamps, tier_loads[seq.request_id])
            self._step.append((stamps, len(seq.token_ids)))
            parents.append(stamps.ranks_parent)
        return tuple(parents)

    def step_done(self) -> None:
        """The step ended: each traced request's part of it is one chunk; a step that ran a
        sequence adds its time to the node's busy seconds (an empty one adds nothing)."""
        now = time.monotonic()
        if self._step_works:
            self.busy_seconds += now - self._step_start
            if self.metrics is not None:
                self.metrics.busy.inc(now - self._step_start)
        for stamps, tokens in self._step:
            stamps.chunks.append((self._step_start, now, tokens))
        self._step.clear()

    def first_token(self, msg: Tokens) -> Tokens:
        """`msg` with the request's stages when it carries the first token computed here;
        as it is otherwise (one dictionary miss per message)."""
        stamps = self._stamps.get(msg.request_id)
        if stamps is None or stamps.first or not msg.token_ids:
            if stamps is not None and msg.finish_reason and not stamps.handoff:
                # a prompt only scored (no token comes), or a request kept for its drafts
                self.forget(msg.request_id, msg.finish_reason if stamps.first else "ended")
            return msg
        stamps.first = time.monotonic()
        stages = self._stages(stamps)
        if self.metrics is not None:
            self.metrics.first_token(stages, stamps.remote)
        if stamps.traceparent is not None:
            self._spans(msg.request_id, stamps, stages)
        if stamps.handoff:
            return replace(msg, stages=stages)
        if msg.finish_reason or not self._speculates(stamps):
            self.forget(msg.request_id, msg.finish_reason or "ended")
        return replace(msg, stages=stages)

    def kv_sent(self, request_id: str, pages: int, ok: bool) -> None:
        """A prefill node sent the request's last KV and its done message (or its transfer
        failed: `ok` False, counted): forget it."""
        if not ok and self.metrics is not None:
            self.metrics.transfer_failed()
        stamps = self._stamps.pop(request_id, None)
        if stamps is None or stamps.traceparent is None:
            return
        attrs = {REQUEST_ID: request_id, "pdserve.kv.connector": self.connector}
        attrs |= {"pdserve.kv.pages": pages, "pdserve.kv.sent": ok}
        start = stamps.scheduled or stamps.taken
        self._span("prefill.kv_send", stamps, start, time.monotonic(), attrs)

    def lease_expired(self, request_id: str, lease_timeout: float) -> None:
        """The request's router stopped renewing its lease (counted): a traced request gets a
        span from its taking to now, and a node span still open ends with that outcome."""
        if self.metrics is not None:
            self.metrics.lease_expired()
        stamps = self._stamps.get(request_id)
        if stamps is not None and stamps.traceparent is not None:
            attrs = {REQUEST_ID: request_id, "pdserve.lease_timeout": lease_timeout}
            self._span("node.lease_expired", stamps, stamps.taken, time.monotonic(), attrs)
        self.forget(request_id, "lease_expired")

    def forget(self, request_id: str, outcome: str = "ended") -> None:
        """The request ended here (aborted, failed; or finished, kept for its drafts): no
        stage of it is reported; a node span still open ends now, a traced request that
        decoded here on a speculating node gets its `decode.speculation` span."""
        stamps = self._stamps.pop(request_id, None)
        if stamps is None:
            return
        if stamps.span is not None:
            assert self.tracer is not None
            self.tracer.end(stamps.span, time.monotonic(), {"pdserve.outcome": outcome})
        if stamps.first and self._speculates(stamps):
            self._speculation(request_id, stamps, outcome)

    # -- stages and spans ----------------------------------------------------------------

    def _speculates(self, s: _Stamps) -> bool:
        """A traced request this node decodes with drafts (kept to its end)."""
        return bool(self.spec_method) and s.traceparent is not None and not s.handoff

    def _speculation(self, rid: str, s: _Stamps, outcome: str) -> None:
        """A traced request's drafts on this node, from its first decode step to its end."""
        spec = s.spec or SpecDecodeStats()
        attrs = {REQUEST_ID: rid, "pdserve.spec.method": self.spec_method}
        attrs |= {"pdserve.spec.num_drafts": spec.num_drafts, "pdserve.outcome": outcome}
        attrs["pdserve.spec.num_draft_tokens"] = spec.num_draft_tokens
        attrs["pdserve.spec.num_accepted_tokens"] = spec.num_accepted_tokens
        start = s.scheduled if s.remote else s.first
        self._span("decode.speculation", s, start, time.monotonic(), attrs)

    def _tier_span(self, rid: str, s: _Stamps, loads: TierLoads) -> None:
        """What the request's prefix lookups loaded from the tiers under the pool (blocks by
        tier kind), chose to recompute, and the bytes loaded: a span under the node's."""
        assert self.tracer is not None
        attrs: dict[str, Any] = {REQUEST_ID: rid, "pdserve.node_id": self.node_id}
        attrs["pdserve.kv_tier.recompute_chosen_blocks"] = loads.recompute_chosen
        attrs |= {"pdserve.kv_tier.bytes": loads.bytes, "pdserve.kv_tier.tokens": loads.tokens}
        for name, n in loads.blocks.items():
            key = f"pdserve.kv_tier.{tier_label(name)}.blocks"
            attrs[key] = attrs.get(key, 0) + n
        self.tracer.span("node.tier_load", s.span, loads.start, loads.end, attrs)

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

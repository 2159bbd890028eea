"""A node's request-level Prometheus metrics, in vLLM's names (`pdserve:` for `vllm:`).

The node loop observes them where a request's stage ends (`StageClock`, the KV hand-off, a
lease's expiry); the health endpoint serves them with its gauges (`health.HealthServer`).
prometheus_client's metrics lock their own values, so the loop's thread writes and the health
thread reads without the loop taking a lock of its own. Every series carries the node's labels
(`role`, `node_id`), so one dashboard query can sum them across nodes or split them by role.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.common.node.tier_metrics import TierCollector
from pdserve.common.wire.payloads import StageTimes

# Request times from 1 ms (a tiny model's prefill on a CPU) to 10 min (a long prompt queued).
SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
# KV bytes of one request: 4 KiB (a tiny model's block) to 16 GiB, by powers of 4.
BYTES = tuple(float(4**i) for i in range(6, 18))


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
)  # fmt: skip


class NodeMetrics:
    """The request-level metrics of one node process (rank 0 of a tensor-parallel group): one
    series of each metric in `_SERIES`, under the node's labels."""

    queue_time: Any
    prefill_time: Any
    kv_time: Any
    kv_bytes: Any
    kv_failed: Any
    leases_expired: Any

    def __init__(self, labels: dict[str, str], connector: str = "", block_bytes: int = 0) -> None:
        """`connector`: the node's KV connector ("" for a node that moves no KV: "none");
        `block_bytes`: one block's KV across every layer and head (`KVLayout.block_bytes`).
        Every series exists from the start: a scrape before the first event reads 0."""
        self.registry = CollectorRegistry()
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
        self.kv_bytes.observe(pages * self._block_bytes)

    def transfer_failed(self) -> None:
        self.kv_failed.inc()

    def lease_expired(self) -> None:
        self.leases_expired.inc()

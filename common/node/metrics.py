"""A node's request-level Prometheus metrics, in vLLM's names (`pdserve:` for `vllm:`).

The node loop observes them where a request's stage ends (`StageClock`, the KV hand-off, a
lease's expiry); the health endpoint serves them with its gauges (`health.HealthServer`).
prometheus_client's metrics lock their own values, so the loop's thread writes and the health
thread reads without the loop taking a lock of its own. Every series carries the node's labels
(`role`, `node_id`), so one dashboard query can sum them across nodes or split them by role.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.common.wire.payloads import StageTimes

# vLLM's request-time buckets (0.3 s to 2 h would hide a CPU node's milliseconds: both).
SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
# KV bytes of one request: 4 KiB (a tiny model's block) to 16 GiB, by powers of 4.
BYTES = tuple(float(4**i) for i in range(6, 18))


class NodeMetrics:
    """The request-level metrics of one node process (rank 0 of a tensor-parallel group)."""

    def __init__(self, labels: dict[str, str], connector: str = "", block_bytes: int = 0) -> None:
        """`connector`: the node's KV connector ("" for a node that moves no KV);
        `block_bytes`: one block's KV across every layer and head (`KVLayout.block_bytes`)."""
        self.registry = CollectorRegistry()
        self._labels = labels
        self._block_bytes = block_bytes
        self._kv_labels = labels | {"connector": connector}
        names = list(labels)
        kv = [*names, "connector"]
        reg = self.registry
        self.queue_time = Histogram(
            "pdserve:request_queue_time_seconds",
            "Taken by the node to the first step that ran it (a decode node: KV whole to it)",
            names, buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.prefill_time = Histogram(
            "pdserve:request_prefill_time_seconds",
            "The first step that ran the prompt to its first token (every chunk)",
            names, buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.kv_time = Histogram(
            "pdserve:kv_transfer_time_seconds",
            "One request's KV transfer on its decode node: blocks reserved to KV whole on "
            "every rank (pages stream as the prefill's layers finish: overlaps the prefill)",
            kv, buckets=SECONDS, registry=reg,
        )  # fmt: skip
        self.kv_bytes = Histogram(
            "pdserve:kv_transfer_bytes",
            "KV bytes one request's transfer wrote into its decode node (every rank)",
            kv, buckets=BYTES, registry=reg,
        )  # fmt: skip
        self.kv_failed = Counter(
            "pdserve:kv_transfer_failures",
            "Requests whose KV transfer failed (damaged or missing slices, a broken connection)",
            kv, registry=reg,
        )  # fmt: skip
        self.leases_expired = Counter(
            "pdserve:lease_expirations",
            "Requests freed because their router stopped renewing their lease",
            names, registry=reg,
        )  # fmt: skip
        # Every series from the start: a scrape before the first event reads 0, not nothing.
        for metric in (self.queue_time, self.prefill_time, self.leases_expired):
            metric.labels(**labels)
        if connector:
            for metric in (self.kv_time, self.kv_bytes, self.kv_failed):
                metric.labels(**self._kv_labels)

    def first_token(self, stages: StageTimes, remote: bool) -> None:
        """A request's stages up to the first token this node computed (`remote`: its KV came
        from a prefill node; its queue is the wait for admission)."""
        labels = self._labels
        if remote:
            self.queue_time.labels(**labels).observe(stages.admission)
            return
        self.queue_time.labels(**labels).observe(stages.queue)
        self.prefill_time.labels(**labels).observe(stages.prefill)

    def kv_received(self, seconds: float, pages: int, ok: bool) -> None:
        """A request's KV transfer of `pages` blocks ended on every rank of this decode node."""
        if not ok:
            self.transfer_failed()
            return
        self.kv_time.labels(**self._kv_labels).observe(seconds)
        self.kv_bytes.labels(**self._kv_labels).observe(pages * self._block_bytes)

    def transfer_failed(self) -> None:
        self.kv_failed.labels(**self._kv_labels).inc()

    def lease_expired(self) -> None:
        self.leases_expired.labels(**self._labels).inc()

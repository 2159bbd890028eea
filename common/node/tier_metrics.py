"""The KV tiers' series on a node's /metrics (docs/api.md, docs/kv_tiers.md): per tier (label
`tier`: host, file, redis) hits, misses, bytes loaded and stored, load time, store errors,
objects refused, the fitted load rate and latency, and the blocks recomputed by choice; per
node the prompt tokens loaded from a tier instead of recomputed.

The node loop publishes a `TierReport` with its gauges (`loop.EngineNode.publish_gauges`); the
health thread's scrape reads the last one (a reference swap, as the gauges), never the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.wire.payloads import TierCounts

if TYPE_CHECKING:
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.kv_store.cost import TierRate
    from pdserve.kv_store.tier import TierStats

# Counter name (exported with `_total`) -> (TierStats field, help).
TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "pdserve:kv_tier_hits": ("hits", "blocks read whole and verified from the tier"),
    "pdserve:kv_tier_misses": ("misses", "reads without a verified block (errors included)"),
    "pdserve:kv_tier_loaded_bytes": ("bytes_read", "payload bytes of the blocks read"),
    "pdserve:kv_tier_stored_bytes": ("bytes_written", "bytes of the objects stored"),
    "pdserve:kv_tier_load_seconds": ("load_seconds", "time in the tier's reads"),
    "pdserve:kv_tier_errors": ("errors", "backend errors and timeouts (each a miss or lost put)"),
    "pdserve:kv_tier_bad_objects": ("bad_objects", "objects refused: checksum, length, layout"),
}
PREFIX = "pdserve:kv_tier_"
TOKENS_LOADED = "pdserve:kv_tier_loaded_tokens"
RECOMPUTE_CHOSEN = "pdserve:kv_tier_recompute_chosen"
LOAD_RATE = "pdserve:kv_tier_load_bytes_per_second"
LOAD_LATENCY = "pdserve:kv_tier_load_latency_seconds"


@dataclass(frozen=True, slots=True)
class TierReport:
    """One engine's tier counters at a moment (`tier_report`)."""

    tiers: tuple[TierStats, ...] = ()
    rates: tuple[TierRate, ...] = ()
    tokens_loaded: int = 0  # prompt tokens loaded from a tier instead of recomputed


def tier_report(engine: LLMEngine) -> TierReport:
    tiers = engine.tiers
    if tiers is None:
        return TierReport()
    return TierReport(tiers.stats(), tiers.cost.rates(), engine.kv.stats.tier_hits)


def tier_counts(report: TierReport) -> tuple[TierCounts, ...]:
    """The report's counters per tier as a heartbeat carries them (`TierCounts`, whose fields
    are the counters' names without `pdserve:kv_tier_`), for the router to sum."""
    chosen = {tier_label(r.tier): r.recompute_chosen for r in report.rates}
    out = []
    for stats in report.tiers:
        values = {
            name.removeprefix(PREFIX): getattr(stats, field)
            for name, (field, _) in TIER_COUNTERS.items()
        }
        counts = {k: v if k == "load_seconds" else int(v) for k, v in values.items()}
        label = tier_label(stats.tier)
        out.append(TierCounts(label, **counts, recompute_chosen=chosen.get(label, 0)))
    return tuple(out)


def tier_label(name: str) -> str:
    """A tier's kind from its name: host, file (file://DIR), redis (redis://...)."""
    return name.split(":", 1)[0]


class TierCollector(Collector):
    """The last published `TierReport` as Prometheus families under the node's labels."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self.report = TierReport()

    def publish(self, report: TierReport) -> None:
        self.report = report

    def collect(self) -> Iterator[Metric]:
        report, names = self.report, [*self._labels, "tier"]
        node = list(self._labels.values())
        for name, (field, text) in TIER_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=names)
            for stats in report.tiers:
                family.add_metric([*node, tier_label(stats.tier)], getattr(stats, field))
            yield family
        chosen = CounterMetricFamily(
            RECOMPUTE_CHOSEN, "blocks recomputed because loading was judged slower", labels=names
        )
        rate = GaugeMetricFamily(LOAD_RATE, "fitted load rate (0: none yet)", labels=names)
        text = "fitted fixed time of a load, whatever its bytes"
        latency = GaugeMetricFamily(LOAD_LATENCY, text, labels=names)
        for r in report.rates:
            chosen.add_metric([*node, tier_label(r.tier)], r.recompute_chosen)
            rate.add_metric([*node, tier_label(r.tier)], r.bytes_per_s)
            latency.add_metric([*node, tier_label(r.tier)], r.latency_s)
        yield chosen
        yield rate
        yield latency
        text = "prompt tokens loaded from a KV tier instead of recomputed"
        tokens = CounterMetricFamily(TOKENS_LOADED, text, labels=list(self._labels))
        tokens.add_metric(node, report.tokens_loaded)
        yield tokens

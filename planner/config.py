"""`PlannerConfig`: the SLOs, thresholds and bounds of the planner, each field a flag of its
name (`--ttft-slo`, `--min-prefill`, ...) through `common.options.option`, so that the simulator
and `pdserve serve` read one declaration."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.options import option

SLO, SIZING, BOUNDS = "planner: SLOs", "planner: sizing", "planner: bounds"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """What the planner aims at and how far it may go.

    Prefill is sized by the uncached prompt tokens per second it must compute: the arrivals'
    plus the queue drained within `queue_share` of the TTFT SLO (llm-d's budget), over the
    prefill rate measured through P/D. Decode is sized by the answer tokens per second over
    what one decode node sustains within the ITL SLO, and by KV usage. A pool grows when the
    need exceeds `util_high` of its capacity and shrinks only to a size whose survivors stay
    under `util_low` (the gap is the hysteresis); a shrink also waits until every need inside
    the last `window` seconds allows it (or the deployment has been idle for two decisions).
    """

    ttft_slo: float = option(2.0, SLO, "p90 time to first token the planner aims at (s)")
    itl_slo: float = option(0.05, SLO, "p90 inter-token latency the planner aims at (s)")
    interval: float = option(10.0, SIZING, "seconds between two decisions")
    window: float = option(60.0, SIZING, "a pool shrinks only if every need in this many s allows")
    smoothing: float = option(10.0, SIZING, "arrivals are averaged over about this many s")
    burst_slos: float = option(5.0, SIZING, "and over at least this many TTFT SLOs")
    trend: float = option(180.0, SIZING, "the arrivals' rise is read off a mean over this many s")
    lead: float = option(70.0, SIZING, "and planned for this many s ahead (a node's start)")
    queue_share: float = option(0.5, SIZING, "share of the TTFT SLO the queue may wait")
    util_high: float = option(0.8, SIZING, "grow a pool when its need passes this share")
    util_low: float = option(0.65, SIZING, "shrink only to survivors under this share")
    kv_high: float = option(0.8, SIZING, "grow decode when its KV usage passes this share")
    kv_low: float = option(0.6, SIZING, "shrink decode only to survivors under this KV share")
    max_age: float = option(30.0, SIZING, "measurements older than this make no decision (s)")
    start_timeout: float = option(600.0, SIZING, "a node not ready after this is stopped (s)")
    min_prefill: int = option(1, BOUNDS, "fewest prefill nodes")
    max_prefill: int = option(64, BOUNDS, "most prefill nodes")
    min_decode: int = option(1, BOUNDS, "fewest decode nodes")
    max_decode: int = option(64, BOUNDS, "most decode nodes")
    max_nodes: int = option(128, BOUNDS, "most nodes of both roles together")

    def __post_init__(self) -> None:
        positive = ("ttft_slo", "itl_slo", "interval", "smoothing", "trend", "max_age")
        for name in (*positive, "start_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        for name in ("window", "burst_slos", "lead"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for low, high in (("util_low", "util_high"), ("kv_low", "kv_high")):
            if not 0 < getattr(self, low) < getattr(self, high) <= 1:
                raise ValueError(f"need 0 < {low} < {high} <= 1 (the gap is the hysteresis)")
        if not 0 < self.queue_share <= 1:
            raise ValueError("--queue-share must be in (0, 1]")
        self._check_bounds()

    def _check_bounds(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError("need 0 <= --min-prefill <= --max-prefill")
        if not 0 <= self.min_decode <= self.max_decode:
            raise ValueError("need 0 <= --min-decode <= --max-decode")
        if self.min_prefill + self.min_decode > self.max_nodes:
            raise ValueError("--min-prefill plus --min-decode exceed --max-nodes")

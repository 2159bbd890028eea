"""What the planner reads: one `Snapshot` of the deployment's measurements per interval, built
by the simulator or by `pdserve serve` from the router's metrics, never read from a node by the
policy itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the planner sees it: its role, whether it serves yet, since when it was
    started, and whether it is draining (asked to leave or to switch roles)."""

    node_id: str
    role: str
    ready: bool
    started_at: float
    draining: bool = False


@dataclass(frozen=True, slots=True)
class TtftShares:
    """Where the interval's time to first token went (the router's per-stage histograms,
    `pdserve:ttft_stage_seconds`), as shares of their total: waiting for a prefill node (the
    router's queue, the node's inbox and queue) and waiting for a decode node's reservation.
    The rest is the prefill itself and the router's own work, which no added node shortens."""

    prefill_wait: float
    decode_wait: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The measurements of one moment (`at`, seconds on the planner's clock).

    Rates are per node: `prefill_rate` the uncached prompt tokens per second one prefill node
    computes, measured through the P/D path; `decode_rate` the answer tokens per second one
    decode node sustains within the ITL SLO. None or NaN means "not measured". The arrival
    figures cover the last interval; `kv_usage` is the share of the ready decode nodes' KV in
    use; the percentiles are None when no request reached that stage in the interval;
    `ttft_shares` None where the stages are not measured (the simulator) or none finished.
    """

    at: float
    arrival_rate: float  # requests per second
    mean_prompt_tokens: float  # uncached prompt tokens per arriving request
    mean_output_tokens: float  # answer tokens asked per arriving request
    queued_prompt_tokens: float  # uncached prompt tokens not yet computed
    kv_usage: float
    prefill_rate: float | None
    decode_rate: float | None
    ttft_p90: float | None
    itl_p90: float | None
    nodes: tuple[NodeView, ...]
    ttft_shares: TtftShares | None = None

    def demand(self) -> tuple[float, ...]:
        """The figures every decision needs (a NaN or None among them: no decision)."""
        return (
            self.arrival_rate,
            self.mean_prompt_tokens,
            self.mean_output_tokens,
            self.queued_prompt_tokens,
            self.kv_usage,
        )

    def idle(self) -> bool:
        """Nothing arrives, nothing waits, no KV is held: every pool may go to its minimum
        (without a measured rate: an idle deployment measures none)."""
        return self.arrival_rate == 0 and self.queued_prompt_tokens == 0 and self.kv_usage == 0


def measured(value: float | None) -> bool:
    """A usable measurement: present, finite, not negative."""
    return value is not None and math.isfinite(value) and value >= 0

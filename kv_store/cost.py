"""Load or recompute (issue 40): whether reading a hit from a tier is faster than prefilling
its tokens again, from the rates this node measured.

A tier's rate is bytes loaded per second of its loads (a moving average over the hits it
served: the chain's walk to it, the read, the check, the copy into the pool); the prefill rate
is the engine's (`PrefillRate`: prompt tokens per second of recent prefill steps). Loading
`nbytes` for `n_tokens` costs `nbytes / tier rate`; recomputing them `n_tokens / prefill
rate`. Both are linear in a request's blocks, so a request's decision is its first block's,
and the pool asks once per block as it walks the request's prefix.

Until both rates are measured a hit is loaded (that is how a tier's rate gets measured). A
tier found slower is not asked at all, and its hits are recomputed, until `probe_every`
skipped blocks later one block is loaded anyway to measure it again: a store that was slow
(a busy server, a cold disk) is tried again, at the cost of one block per `probe_every`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.engine.config import KV_LOAD_POLICIES

POLICIES = KV_LOAD_POLICIES


@dataclass(frozen=True, slots=True)
class TierRate:
    """One tier's view in the cost model: its measured load rate (0: none yet) and the
    blocks the model chose to recompute rather than ask it for."""

    tier: str
    bytes_per_s: float
    recompute_chosen: int


class LoadCost:
    """The load-or-recompute decision of one engine (`policy` "always" loads every hit and
    only measures; "cost" decides)."""

    def __init__(
        self,
        prefill_tokens_per_s: Callable[[], float],
        policy: str = "cost",
        weight: float = 0.2,
        probe_every: int = 32,
    ) -> None:
        if policy not in POLICIES or not 0 < weight <= 1 or probe_every < 1:
            raise ValueError(f"kv load policy {policy!r} (use {POLICIES}), weight in (0, 1]")
        self.policy = policy
        self._prefill = prefill_tokens_per_s
        self._weight = weight
        self._probe_every = probe_every
        self._rates: dict[str, float] = {}
        self._skipped: dict[str, int] = {}  # since the tier was last loaded from
        self._chosen: dict[str, int] = {}
        self._lock = threading.Lock()  # metrics read the rates from another thread

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of `nbytes` from `tier` took `seconds`, end to end."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rates.get(tier, 0.0)
            self._rates[tier] = rate if not old else old + self._weight * (rate - old)

    def estimate(self, tier: str, n_tokens: int, nbytes: int) -> tuple[float, float] | None:
        """(seconds to load, seconds to recompute), or None while either rate is unknown."""
        with self._lock:
            rate = self._rates.get(tier, 0.0)
        prefill = self._prefill()
        if rate <= 0 or prefill <= 0:
            return None
        return nbytes / rate, n_tokens / prefill

    def worth_loading(self, tier: str, n_tokens: int, nbytes: int) -> bool:
        """Whether to load `n_tokens` of KV (`nbytes`) from `tier` rather than recompute them:
        no slower by the measured rates, or unmeasured, or due for a probe."""
        est = self.estimate(tier, n_tokens, nbytes)
        if self.policy == "always" or est is None or est[0] <= est[1]:
            self._skipped[tier] = 0
            return True
        skipped = self._skipped.get(tier, 0) + 1
        if skipped >= self._probe_every:
            self._skipped[tier] = 0
            return True
        self._skipped[tier] = skipped
        with self._lock:
            self._chosen[tier] = self._chosen.get(tier, 0) + 1
        return False

    def rates(self) -> tuple[TierRate, ...]:
        with self._lock:
            tiers = sorted({*self._rates, *self._chosen})
            return tuple(
                TierRate(t, self._rates.get(t, 0.0), self._chosen.get(t, 0)) for t in tiers
            )

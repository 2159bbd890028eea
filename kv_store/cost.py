"""Load or recompute (issue 40): whether reading a run of hit blocks from a tier is faster than
prefilling their tokens again, from what this node measured.

Recomputing is priced by the marginal prefill cost (`PrefillCost`): a step's compute time is
fitted online as `a + b·tokens + d·pairs`, where a sequence's chunk of n new tokens over c
cached ones adds n tokens and n·c + n²/2 query-key pairs (its attention). Recomputing the
tokens [s, e) of a prompt that prefills on to its end anyway then adds `b·(e - s) + d·(e² -
s²)/2` seconds: the pairs of a prefill from position p to L are (L² - p²)/2, so the remainder
after e cancels out. A block late in a long prompt costs more to recompute than an early one,
which an average rate (tokens per second of recent steps) cannot say: it priced every token
alike, and its error was 15-130% on issue 40's workloads.

Loading is priced by each tier's measured rate: bytes loaded per second of its loads (a moving
average over the hits it served: the chain's walk to it, the read, the check, the copy into
the pool).

A walk over a request's missing blocks asks each tier once, for the run from the first block
it is asked for to the end of the walk: loading blocks s..e-1 (a contiguous run; a later block
without the earlier ones is no prefix) against recomputing them. Since recomputing a block
costs more the later it sits, the run is loaded whole or not at all.

Until both are measured a hit is loaded (that is how a tier's rate gets measured). A tier found
slower is not asked, and its hits are recomputed, until `probe_every` runs later one is loaded
anyway to measure it again: a store that was slow (a busy server, a cold disk) is tried again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pdserve.common.engine.config import KV_LOAD_POLICIES
from pdserve.common.engine.scheduler import SchedulerOutput

POLICIES = KV_LOAD_POLICIES


@dataclass(frozen=True, slots=True)
class StepModel:
    """A step's fitted compute time: `fixed_s + token_s·tokens + pair_s·pairs` seconds."""

    fixed_s: float
    token_s: float
    pair_s: float

    def recompute_s(self, start: int, end: int) -> float:
        """The seconds that prefilling tokens [start, end) adds to a prompt's prefill."""
        return self.token_s * (end - start) + self.pair_s * (end * end - start * start) / 2

    def step_s(self, chunks: Iterable[tuple[int, int]]) -> float:
        """The predicted time of a step of (new tokens, cached tokens) chunks."""
        tokens, pairs = _features(chunks)
        return self.fixed_s + self.token_s * tokens + self.pair_s * pairs


def _features(chunks: Iterable[tuple[int, int]]) -> tuple[float, float]:
    tokens = pairs = 0.0
    for n, c in chunks:
        tokens += n
        pairs += n * c + n * n / 2
    return tokens, pairs


class PrefillCost:
    """`StepModel` fitted by exponentially weighted least squares (`decay` per step) over the
    steps that prefilled (decode-only steps run another regime: memory-bound GEMVs). No
    coefficient is negative (a feature that would get one is left out of the fit). Until
    `min_steps` such steps were seen, only the per-token term is fitted (an average rate)."""

    def __init__(self, decay: float = 0.98, min_steps: int = 8) -> None:
        if not 0 < decay <= 1 or min_steps < 1:
            raise ValueError(f"decay in (0, 1] and min_steps >= 1, got {decay}, {min_steps}")
        self.decay = decay
        self.min_steps = min_steps
        self.steps = 0
        self._xx = np.zeros((3, 3))  # weighted sums of x·xᵀ and x·y, x = (1, tokens, pairs)
        self._xy = np.zeros(3)
        self._model: StepModel | None = None
        self._lock = threading.Lock()  # fitted on the engine's thread, read by metrics

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """One engine step's compute time; steps without a prefill chunk are left out."""
        if any(seq.num_known_tokens > 1 for seq in output.seqs):
            self.observe([(seq.num_known_tokens, seq.start_pos) for seq in output.seqs], seconds)

    def observe(self, chunks: Iterable[tuple[int, int]], seconds: float) -> None:
        """A step of (new tokens, cached tokens) chunks took `seconds` to compute."""
        if seconds <= 0:
            return
        x = np.array([1.0, *_features(chunks)])
        with self._lock:
            self._xx = self.decay * self._xx + np.outer(x, x)
            self._xy = self.decay * self._xy + x * seconds
            self.steps += 1
            self._model = self._fit()

    def model(self) -> StepModel | None:
        """The current fit, or None before any prefill step."""
        with self._lock:
            return self._model

    def _fit(self) -> StepModel | None:
        keep = [0, 1, 2] if self.steps >= self.min_steps else [1]
        while keep:
            sub = np.ix_(keep, keep)
            coef = np.linalg.lstsq(self._xx[sub], self._xy[keep], rcond=None)[0]
            if (coef >= 0).all():
                full = np.zeros(3)
                full[keep] = coef
                return StepModel(*map(float, full)) if full[1] + full[2] > 0 else None
            del keep[int(np.argmin(coef))]
        return None


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
        prefill: PrefillCost,
        policy: str = "cost",
        weight: float = 0.2,
        probe_every: int = 32,
    ) -> None:
        if policy not in POLICIES or not 0 < weight <= 1 or probe_every < 1:
            raise ValueError(f"kv load policy {policy!r} (use {POLICIES}), weight in (0, 1]")
        self.policy = policy
        self.prefill = prefill
        self._weight = weight
        self._probe_every = probe_every
        self._rates: dict[str, float] = {}
        self._skipped: dict[str, int] = {}  # runs recomputed since the tier was last loaded
        self._chosen: dict[str, int] = {}
        self._lock = threading.Lock()  # metrics read the rates from another thread

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        self.prefill.observe_step(output, seconds)

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of `nbytes` from `tier` took `seconds`, end to end."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rates.get(tier, 0.0)
            self._rates[tier] = rate if not old else old + self._weight * (rate - old)

    def estimate(self, tier: str, start: int, end: int, nbytes: int) -> tuple[float, float] | None:
        """(seconds to load the KV of tokens [start, end), `nbytes`, from `tier`; seconds to
        recompute them), or None while either is unmeasured."""
        with self._lock:
            rate = self._rates.get(tier, 0.0)
        model = self.prefill.model()
        if rate <= 0 or model is None:
            return None
        return nbytes / rate, model.recompute_s(start, end)

    def worth_loading(self, tier: str, start: int, end: int, nbytes: int, blocks: int) -> bool:
        """Whether to load the run of `blocks` blocks holding tokens [start, end) (`nbytes`)
        from `tier` rather than recompute them: no slower by the model, or unmeasured, or due
        for a probe."""
        est = self.estimate(tier, start, end, nbytes)
        if self.policy == "always" or est is None or est[0] <= est[1]:
            self._skipped[tier] = 0
            return True
        skipped = self._skipped.get(tier, 0) + 1
        if skipped >= self._probe_every:
            self._skipped[tier] = 0
            return True
        self._skipped[tier] = skipped
        with self._lock:
            self._chosen[tier] = self._chosen.get(tier, 0) + blocks
        return False

    def rates(self) -> tuple[TierRate, ...]:
        with self._lock:
            tiers = sorted({*self._rates, *self._chosen})
            return tuple(
                TierRate(t, self._rates.get(t, 0.0), self._chosen.get(t, 0)) for t in tiers
            )

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

Loading is priced by each tier's fitted load time: `latency_s + bytes / rate`, where a run's
loads (the chain's walk to the tier, the read, the check, the copies into the pool) are timed
together as one observation and fitted by exponentially weighted least squares, as the prefill
steps are. The fixed term is what a load of one or two blocks mostly costs (a Redis round
trip, the walk, the copy's setup): priced by bytes alone, such a load looked nearly free and
lost to recomputing (issue 40's trace: a 30-token prompt loading 16 tokens, 0.87x).

A walk over a request's missing blocks asks each tier once, for the run from the first block
it is asked for to the end of the walk: loading blocks s..e-1 (a contiguous run; a later block
without the earlier ones is no prefix) against recomputing them. Since recomputing a block
costs more the later it sits, the run is loaded whole or not at all.

Until both are measured a hit is loaded (that is how a tier's rate gets measured). A run that
a tier would load more slowly than recomputing is recomputed. After `probe_every` such runs,
the tier is probed (loaded anyway, to measure it again: a store that was slow, a busy server,
a cold disk, may be fast again), but only on a run whose predicted loss is within
`probe_loss` of the request's time to first token were the run recomputed (at least a step's
fixed cost and the run's), so that a probe costs no request more than the model's error
allows.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
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
        coef = nonnegative_fit(
            self._xx, self._xy, [0, 1, 2] if self.steps >= self.min_steps else [1]
        )
        return StepModel(*map(float, coef)) if coef is not None and coef[1] + coef[2] > 0 else None


def nonnegative_fit(xx: np.ndarray, xy: np.ndarray, keep: list[int]) -> np.ndarray | None:
    """The least-squares coefficients of the normal equations `xx`·c = `xy` over the features
    `keep` (the others 0), none negative: the feature that would get the most negative one
    leaves the fit, and it is solved again; None when no feature is left."""
    keep = list(keep)
    while keep:
        sub = np.ix_(keep, keep)
        coef = np.linalg.lstsq(xx[sub], xy[keep], rcond=None)[0]
        if (coef >= 0).all():
            full = np.zeros(len(xy))
            full[keep] = coef
            return full
        del keep[int(np.argmin(coef))]
    return None


MB = 1e6  # bytes are fitted in MB: the normal equations stay well scaled


@dataclass(frozen=True, slots=True)
class LoadModel:
    """A tier's fitted load time: `latency_s + nbytes / bytes_per_s` seconds."""

    latency_s: float
    bytes_per_s: float  # math.inf: the loads' time did not grow with their bytes

    def load_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


class LoadFit:
    """`LoadModel` of one tier fitted by exponentially weighted least squares (`decay` per
    load) over its observed loads, no coefficient negative. Until `min_loads` loads, or while
    their sizes hardly differ (a latency cannot be told from a rate then), only the rate is
    fitted (an average rate, latency 0)."""

    def __init__(self, decay: float = 0.9, min_loads: int = 6, min_spread: float = 0.1) -> None:
        if not 0 < decay <= 1 or min_loads < 1:
            raise ValueError(f"decay in (0, 1] and min_loads >= 1, got {decay}, {min_loads}")
        self.decay, self.min_loads, self.min_spread = decay, min_loads, min_spread
        self.loads = 0
        self._xx = np.zeros((2, 2))  # weighted sums of x·xᵀ and x·y, x = (1, MB)
        self._xy = np.zeros(2)
        self.model: LoadModel | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        x = np.array([1.0, nbytes / MB])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.loads += 1
        self.model = self._fit()

    def _spread(self) -> float:
        """The weighted coefficient of variation of the loads' sizes."""
        mean = self._xx[0, 1] / self._xx[0, 0]
        var = max(0.0, self._xx[1, 1] / self._xx[0, 0] - mean * mean)
        return var**0.5 / mean if mean > 0 else 0.0

    def _fit(self) -> LoadModel | None:
        both = self.loads >= self.min_loads and self._spread() >= self.min_spread
        coef = nonnegative_fit(self._xx, self._xy, [0, 1] if both else [1])
        if coef is None or coef.sum() <= 0:
            return None
        return LoadModel(float(coef[0]), float(MB / coef[1]) if coef[1] > 0 else math.inf)


@dataclass(frozen=True, slots=True)
class TierRate:
    """One tier's view in the cost model: its fitted load rate (0: none yet) and latency,
    and the blocks the model chose to recompute rather than ask it for."""

    tier: str
    bytes_per_s: float
    recompute_chosen: int
    latency_s: float = 0.0


class LoadCost:
    """The load-or-recompute decision of one engine (`policy` "always" loads every hit and
    only measures; "cost" decides)."""

    def __init__(
        self,
        prefill: PrefillCost,
        policy: str = "cost",
        probe_every: int = 32,
        probe_loss: float = 0.1,
        fit: Callable[[], LoadFit] = LoadFit,
    ) -> None:
        if policy not in POLICIES or probe_every < 1 or probe_loss < 0:
            raise ValueError(
                f"kv load policy {policy!r} (use {POLICIES}), probe_every >= 1, probe_loss >= 0"
            )
        self.policy = policy
        self.prefill = prefill
        self._probe_every, self._probe_loss = probe_every, probe_loss
        self._new_fit = fit
        self._fits: dict[str, LoadFit] = {}
        self._skipped: dict[str, int] = {}  # runs recomputed since the tier was last loaded
        self._chosen: dict[str, int] = {}
        self._lock = threading.Lock()  # metrics read the fits from another thread

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        self.prefill.observe_step(output, seconds)

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of `nbytes` from `tier` (a run's blocks) took `seconds`, end to end."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            fit = self._fits.get(tier)
            if fit is None:
                fit = self._fits[tier] = self._new_fit()
            fit.observe(nbytes, seconds)

    def load_model(self, tier: str) -> LoadModel | None:
        with self._lock:
            fit = self._fits.get(tier)
            return fit.model if fit is not None else None

    def estimate(
        self, tier: str, start: int, end: int, nbytes: int
    ) -> tuple[float, float, float] | None:
        """(seconds to load the KV of tokens [start, end), `nbytes`, from `tier`; seconds to
        recompute them; the least time to first token of a request recomputing them: a
        step's fixed cost and theirs), or None while either is unmeasured."""
        load, model = self.load_model(tier), self.prefill.model()
        if load is None or model is None:
            return None
        recompute_s = model.recompute_s(start, end)
        return load.load_s(nbytes), recompute_s, model.fixed_s + recompute_s

    def worth_loading(self, tier: str, start: int, end: int, nbytes: int, blocks: int) -> bool:
        """Whether to load the run of `blocks` blocks holding tokens [start, end) (`nbytes`)
        from `tier` rather than recompute them: no slower by the model, or unmeasured, or a
        probe (due, and its predicted loss within `probe_loss` of the request's time to first
        token if it recomputed the run: a step's fixed cost and the run's, at least)."""
        est = self.estimate(tier, start, end, nbytes)
        if self.policy == "always" or est is None or est[0] <= est[1]:
            self._skipped[tier] = 0
            return True
        skipped = self._skipped.get(tier, 0) + 1
        if skipped >= self._probe_every and est[0] - est[1] <= self._probe_loss * est[2]:
            self._skipped[tier] = 0
            return True
        self._skipped[tier] = skipped
        with self._lock:
            self._chosen[tier] = self._chosen.get(tier, 0) + blocks
        return False

    def rates(self) -> tuple[TierRate, ...]:
        with self._lock:
            tiers = sorted({*self._fits, *self._chosen})
            models = {t: self._fits[t].model for t in self._fits}
            chosen = dict(self._chosen)
        out = []
        for t in tiers:
            m = models.get(t)
            rate, latency = (m.bytes_per_s, m.latency_s) if m is not None else (0.0, 0.0)
            out.append(TierRate(t, rate, chosen.get(t, 0), latency))
        return tuple(out)

"""Load or recompute: the marginal prefill cost fitted from steps, the decision per contiguous
run of hit blocks from fed rates (no timing), and the pool's tiers following it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pdserve.kv_store import HostTier, TierChain
from pdserve.kv_store.cost import LoadCost, LoadFit, LoadModel, PrefillCost, StepModel, TierRate
from pdserve.kv_store.pool_tiers import PoolTiers
from tests.kv_store.helpers import SPACE

BLOCK = 2  # tokens per block
CACHE_SHAPE = (2, 8, BLOCK, 1, 2)  # planes, blocks, block size, heads, head dim (float32)
BLOCK_BYTES = 2 * BLOCK * 1 * 2 * 4
TRUE = StepModel(fixed_s=0.004, token_s=1e-3, pair_s=2e-7)  # a machine's step, made up


def fitted(model: StepModel = TRUE, steps: int = 40, seed: int = 0) -> PrefillCost:
    """A PrefillCost fed `steps` mixed steps (prefill chunks over ragged contexts, decodes)
    timed exactly by `model`."""
    rng, prefill = random.Random(seed), PrefillCost()
    for _ in range(steps):
        chunks = [(rng.randrange(2, 600), rng.randrange(0, 2000))]
        chunks += [(1, rng.randrange(1, 2000)) for _ in range(rng.randrange(0, 4))]
        prefill.observe(chunks, model.step_s(chunks))
    return prefill


def cost_with(load_bytes_per_s: float, model: StepModel = TRUE, **kw: object) -> LoadCost:
    cost = LoadCost(fitted(model), **kw)  # type: ignore[arg-type]
    if load_bytes_per_s:
        cost.observe("store", 1000, 1000 / load_bytes_per_s)
    return cost


def test_the_fit_recovers_a_step_model_from_mixed_steps() -> None:
    got = fitted().model()
    assert got is not None
    assert got.fixed_s == pytest.approx(TRUE.fixed_s, rel=1e-6)
    assert got.token_s == pytest.approx(TRUE.token_s, rel=1e-6)
    assert got.pair_s == pytest.approx(TRUE.pair_s, rel=1e-6)


def test_recomputing_a_run_costs_what_it_adds_to_the_prefill() -> None:
    """Tokens [s, e) recomputed in front of a prefill to L add the difference of the two
    prefills, whatever L is: a late run costs more than an early one of the same length."""
    for s, e, length in [(0, 16, 100), (64, 96, 500), (64, 96, 2000), (480, 512, 513)]:
        whole, rest = TRUE.step_s([(length - s, s)]), TRUE.step_s([(length - e, e)])
        assert TRUE.recompute_s(s, e) == pytest.approx(whole - rest)
    assert TRUE.recompute_s(1000, 1016) > TRUE.recompute_s(0, 16)


def test_few_steps_fit_an_average_rate_and_decodes_alone_are_left_out() -> None:
    prefill = PrefillCost(min_steps=8)
    assert prefill.model() is None
    decode = SimpleNamespace(num_known_tokens=1, start_pos=50)
    prefill.observe_step(SimpleNamespace(seqs=(decode, decode)), 0.5)  # type: ignore[arg-type]
    assert prefill.model() is None and prefill.steps == 0, "a decode-only step: not a prefill"
    chunk = SimpleNamespace(num_known_tokens=100, start_pos=0)
    prefill.observe_step(SimpleNamespace(seqs=(chunk, decode)), 0.101)  # type: ignore[arg-type]
    got = prefill.model()
    assert got is not None and got.fixed_s == got.pair_s == 0.0
    assert got.token_s == pytest.approx(0.101 / 101), "the step's tokens over its time"


def test_no_coefficient_goes_negative() -> None:
    """Steps whose time falls with context (noise, another process's load) would fit a
    negative pair cost: the pair term leaves the fit instead."""
    prefill = PrefillCost(min_steps=2)
    for n, c in [(100, 0), (100, 1000), (200, 0), (200, 1000), (50, 500)]:
        prefill.observe([(n, c)], 0.001 * n - 1e-6 * c)
    got = prefill.model()
    assert got is not None and got.pair_s == 0.0 and got.token_s > 0 and got.fixed_s >= 0


def test_unmeasured_rates_load() -> None:
    cost = LoadCost(PrefillCost())
    assert cost.estimate("store", 0, 16, 1000) is None
    assert cost.worth_loading("store", 0, 16, 1000, 1)
    cost.observe("store", 1000, 1.0)  # 1000 B/s, still no prefill step
    assert cost.worth_loading("store", 0, 16, 1000, 1)
    cost.observe("host", 1000, 0.0)  # a zero-time load measures nothing
    assert cost.estimate("host", 0, 16, 1000) is None


@pytest.mark.parametrize(
    ("load_bytes_per_s", "start", "end", "load"),
    [
        (1e6, 0, 16, True),  # 1 ms to load, 16 ms to recompute
        (40e3, 0, 16, False),  # 25 ms to load: recompute
        (40e3, 4000, 4016, True),  # the same run late in a prompt: 28.9 ms to recompute
    ],
)
def test_the_faster_way_wins(load_bytes_per_s: float, start: int, end: int, load: bool) -> None:
    cost = cost_with(load_bytes_per_s)
    load_s, recompute_s, ttft_s = cost.estimate("store", start, end, 1000)  # type: ignore[misc]
    assert load_s == pytest.approx(1000 / load_bytes_per_s)
    assert recompute_s == pytest.approx(TRUE.recompute_s(start, end), rel=1e-6)
    assert ttft_s == pytest.approx(TRUE.fixed_s + recompute_s, rel=1e-6)
    assert cost.worth_loading("store", start, end, 1000, 2) is load
    assert cost.rates() == (TierRate("store", pytest.approx(load_bytes_per_s), 2 * (not load)),)


SMOL = StepModel(fixed_s=0.048, token_s=1e-3, pair_s=8e-7)  # SmolLM2's steps on the trace


def test_a_slow_tier_is_probed_only_where_the_loss_is_within_the_models_error() -> None:
    """A tier found slower is loaded anyway every `probe_every` runs to measure it again, but
    only on a run it is predicted to lose by at most `probe_loss` (10%) of the request's
    time to first token were the run recomputed: a step's fixed cost (48 ms) and the run's."""
    recompute_s = SMOL.recompute_s(0, 16)  # 16.1 ms: a probe may lose 6.4 ms
    near = cost_with(1000 / (1.3 * recompute_s), SMOL, probe_every=4)  # loses 4.8 ms
    decisions = [near.worth_loading("store", 0, 16, 1000, 1) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2, "every 4th run is a probe"
    far = cost_with(1000 / (1.5 * recompute_s), SMOL, probe_every=4)  # loses 8.1 ms
    assert not any(far.worth_loading("store", 0, 16, 1000, 1) for _ in range(12))
    assert far.worth_loading("store", 4000, 4016, 1000, 1), "a late run is worth loading"
    for _ in range(3):  # then a probe-due tier waits for a run it would lose little on
        assert not far.worth_loading("store", 0, 16, 1000, 1)
    assert not far.worth_loading("store", 0, 16, 1000, 1), "due, but loses 8.1 ms: no probe"
    assert far.worth_loading("store", 200, 216, 1000, 1), "due, loses 5.5 of 67 ms: probed"
    for _ in range(40):  # the probes find the store fast again
        near.observe("store", 1000, 1e-5)
    assert near.worth_loading("store", 0, 16, 1000, 1)
    assert near.rates()[0].recompute_chosen == 6


def test_always_loads_but_still_measures() -> None:
    cost = cost_with(1000.0, policy="always")
    assert all(cost.worth_loading("store", 0, 16, 1000, 1) for _ in range(5))
    assert cost.rates() == (TierRate("store", 1000.0, 0),)


FIXED = LoadModel(latency_s=0.008, bytes_per_s=50e6)  # a store's round trip and rate, made up
SMOL_BLOCK = 184_320  # a SmolLM2 block of 8 tokens in bf16


def fed(model: LoadModel = FIXED, loads: int = 30, seed: int = 0) -> LoadFit:
    """A LoadFit fed `loads` runs of 1-32 blocks timed exactly by `model`."""
    rng, fit = random.Random(seed), LoadFit()
    for _ in range(loads):
        nbytes = rng.randrange(1, 33) * SMOL_BLOCK
        fit.observe(nbytes, model.load_s(nbytes))
    return fit


def test_the_load_fit_recovers_a_latency_and_a_rate() -> None:
    got = fed().model
    assert got is not None
    assert got.latency_s == pytest.approx(FIXED.latency_s, rel=1e-6)
    assert got.bytes_per_s == pytest.approx(FIXED.bytes_per_s, rel=1e-6)
    few = fed(loads=3).model
    assert few is not None and few.latency_s == 0.0, "too few loads: an average rate"


def test_loads_of_one_size_fit_a_rate_and_no_coefficient_goes_negative() -> None:
    fit = LoadFit()
    for _ in range(10):
        fit.observe(1000, 0.002)
    assert fit.model == LoadModel(0.0, pytest.approx(500e3)), "a latency cannot be told apart"
    shrinking = LoadFit(min_loads=2)  # time falling with size: the rate term leaves the fit
    for nbytes, seconds in [(1000, 0.003), (9000, 0.002), (5000, 0.0025)]:
        shrinking.observe(nbytes, seconds)
    assert shrinking.model is not None
    assert shrinking.model.bytes_per_s == float("inf") and shrinking.model.latency_s > 0


def test_a_run_whose_fixed_cost_exceeds_its_saving_is_recomputed() -> None:
    """Priced by bytes alone, a one-block run looks nearly free; its round trip makes it
    slower than recomputing its tokens, while a long run pays the round trip once and is
    loaded."""
    cost = LoadCost(fitted(), fit=fed)
    cost.observe("store", SMOL_BLOCK, FIXED.load_s(SMOL_BLOCK))
    tiny = cost.estimate("store", 0, 8, SMOL_BLOCK)
    assert tiny is not None and tiny[0] > tiny[1] > SMOL_BLOCK / FIXED.bytes_per_s
    assert not cost.worth_loading("store", 0, 8, SMOL_BLOCK, 1)
    assert cost.worth_loading("store", 0, 256, 32 * SMOL_BLOCK, 32)
    (rate,) = cost.rates()
    assert rate.latency_s == pytest.approx(FIXED.latency_s, rel=1e-6)
    assert rate.bytes_per_s == pytest.approx(FIXED.bytes_per_s, rel=1e-6)
    assert rate.recompute_chosen == 1


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        LoadCost(PrefillCost(), policy="sometimes")
    with pytest.raises(ValueError):
        LoadCost(PrefillCost(), probe_loss=-0.1)
    with pytest.raises(ValueError, match="decay"):
        LoadFit(decay=1.5)
    with pytest.raises(ValueError, match="decay"):
        PrefillCost(decay=0.0)


def pool(cost: LoadCost) -> tuple[PoolTiers, HostTier, torch.Tensor]:
    host = HostTier(1 << 20)
    cache = torch.zeros(CACHE_SHAPE)
    return PoolTiers(TierChain([host]), SPACE, [cache], BLOCK, cost), host, cache


def fill(tiers: PoolTiers, cache: torch.Tensor, blocks: int) -> list[bytes]:
    """Blocks 1..`blocks` of the cache, distinct, offloaded under hashes h1, h2, ..."""
    hashes = []
    for i in range(1, blocks + 1):
        cache[:, i] = (
            torch.arange(BLOCK_BYTES // 4, dtype=torch.float32).view(cache[:, i].shape) + 100 * i
        )
        hashes.append(f"h{i}".encode())
        tiers.offload(hashes[-1], i)
    return hashes


def walk(tiers: PoolTiers, hashes: list[bytes], first: int, into: int) -> int:
    """The manager's walk: blocks loaded, in order, into cache blocks `into`, `into + 1`..."""
    tiers.begin_walk(first, first + len(hashes))
    for i, h in enumerate(hashes):
        if not tiers.load(h, into + i, first + i):
            return i
    return len(hashes)


def test_the_pool_decides_once_per_run_and_loads_it_whole_or_not_at_all() -> None:
    # A host tier measured at 8 ms a block (BLOCK_BYTES / 8 ms): 2-token blocks at the
    # start of a prompt cost ~6 ms each to recompute, late ones (past ~5,000 tokens) more.
    slow = StepModel(fixed_s=0.0, token_s=3e-3, pair_s=1e-6)
    tiers, host, cache = pool(LoadCost(fitted(slow)))
    hashes = fill(tiers, cache, 3)
    tiers.cost.observe("host", BLOCK_BYTES, 8e-3)
    assert walk(tiers, hashes, first=0, into=4) == 0, "early in the prompt: recomputed"
    assert host.stats().hits == host.stats().misses == 0, "the host tier was not asked"
    assert tiers.cost.rates()[0].recompute_chosen == 3, "the run's three blocks"
    assert walk(tiers, hashes, first=3000, into=4) == 3, "late in a long prompt: loaded"
    assert all(torch.equal(cache[:, 4 + i], cache[:, 1 + i]) for i in range(3))
    assert host.stats().hits == 3
    assert tiers.cost.rates()[0].bytes_per_s > BLOCK_BYTES / 8e-3, "the real loads, measured"


class Recorded(LoadFit):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def observe(self, nbytes: int, seconds: float) -> None:
        assert seconds > 0
        self.seen.append(nbytes)
        super().observe(nbytes, seconds)


def test_a_walk_is_one_load_of_its_run_for_the_cost_model() -> None:
    """The fixed cost of a load is paid once a run: each walk's loads from a tier are one
    observation of its bytes, whether the walk ends at its last block, at a miss, or early."""
    fits: list[Recorded] = []

    def new_fit() -> Recorded:
        fits.append(Recorded())
        return fits[-1]

    tiers, _, cache = pool(LoadCost(PrefillCost(), "always", fit=new_fit))
    hashes = fill(tiers, cache, 3)
    assert walk(tiers, hashes, first=0, into=4) == 3
    assert walk(tiers, [hashes[0], b"gone", hashes[2]], first=0, into=4) == 1
    tiers.begin_walk(0, 3)  # the manager stops after one block (no free block left)
    assert tiers.load(hashes[0], 4, 0)
    tiers.begin_walk(0, 1)
    assert [f.seen for f in fits] == [[3 * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES]]

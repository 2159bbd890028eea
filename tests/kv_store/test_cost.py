"""Load or recompute: the decision from measured rates, and the pool's tiers following it."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_store import HostTier, TierChain
from pdserve.kv_store.cost import LoadCost, TierRate
from pdserve.kv_store.pool_tiers import PoolTiers
from tests.kv_store.helpers import SPACE

BLOCK = 2  # tokens per block
CACHE_SHAPE = (2, 4, BLOCK, 1, 2)  # planes, blocks, block size, heads, head dim (float32)
BLOCK_BYTES = 2 * BLOCK * 1 * 2 * 4


class Prefill:
    """A settable prefill rate (tokens/s; 0: not measured yet)."""

    def __init__(self, tokens_per_s: float = 0.0) -> None:
        self.tokens_per_s = tokens_per_s

    def __call__(self) -> float:
        return self.tokens_per_s


def test_unmeasured_rates_load() -> None:
    prefill = Prefill()
    cost = LoadCost(prefill)
    assert cost.estimate("store", 16, 1000) is None and cost.worth_loading("store", 16, 1000)
    cost.observe("store", 1000, 1.0)  # 1000 B/s, still no prefill rate
    assert cost.worth_loading("store", 16, 1000)
    prefill.tokens_per_s = 100.0
    cost.observe("host", 1000, 0.0)  # a zero-time load measures nothing
    assert cost.estimate("host", 16, 1000) is None


@pytest.mark.parametrize(
    ("load_bytes_per_s", "prefill_tokens_per_s", "load"),
    [
        (1e6, 100.0, True),  # 1 ms to load 1000 bytes, 160 ms to recompute 16 tokens
        (1e3, 1e4, False),  # 1 s to load, 1.6 ms to recompute
        (1e3, 16.0, True),  # 1 s either way: a tie loads
    ],
)
def test_the_faster_way_wins(load_bytes_per_s: float, prefill_tokens_per_s: float, load: bool):
    cost = LoadCost(Prefill(prefill_tokens_per_s))
    cost.observe("store", 1000, 1000 / load_bytes_per_s)
    load_s, recompute_s = cost.estimate("store", 16, 1000)  # type: ignore[misc]
    assert load_s == pytest.approx(1000 / load_bytes_per_s)
    assert recompute_s == pytest.approx(16 / prefill_tokens_per_s)
    assert cost.worth_loading("store", 16, 1000) is load
    assert cost.rates() == (TierRate("store", pytest.approx(load_bytes_per_s), int(not load)),)


def test_a_slow_tier_is_probed_again_and_can_recover() -> None:
    cost = LoadCost(Prefill(1e4), probe_every=4)
    cost.observe("store", 1000, 1.0)  # slow: 1 s a block against 1.6 ms
    decisions = [cost.worth_loading("store", 16, 1000) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2, "every 4th is a probe"
    for _ in range(40):  # the probes find the store fast again
        cost.observe("store", 1000, 1e-5)
    assert cost.worth_loading("store", 16, 1000)
    assert cost.rates()[0].recompute_chosen == 6


def test_always_loads_but_still_measures() -> None:
    cost = LoadCost(Prefill(1e4), policy="always")
    cost.observe("store", 1000, 1.0)
    assert all(cost.worth_loading("store", 16, 1000) for _ in range(5))
    assert cost.rates() == (TierRate("store", 1000.0, 0),)


def test_rates_move_by_a_moving_average() -> None:
    cost = LoadCost(Prefill(1.0), weight=0.5)
    cost.observe("host", 100, 1.0)
    cost.observe("host", 300, 1.0)
    assert cost.rates()[0].bytes_per_s == 200.0


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        LoadCost(Prefill(), policy="sometimes")
    with pytest.raises(ValueError):
        LoadCost(Prefill(), weight=0.0)


def pool(cost: LoadCost) -> tuple[PoolTiers, HostTier, torch.Tensor]:
    host = HostTier(1 << 20)
    cache = torch.zeros(CACHE_SHAPE)
    return PoolTiers(TierChain([host]), SPACE, [cache], BLOCK, cost), host, cache


def test_the_pool_does_not_ask_a_tier_slower_than_recomputing() -> None:
    prefill = Prefill(1e6)  # 2 µs to recompute a block
    tiers, host, cache = pool(LoadCost(prefill))
    cache[:, 1] = torch.arange(BLOCK_BYTES // 4, dtype=torch.float32).view(cache[:, 1].shape)
    tiers.offload(b"h1", 1)
    tiers.cost.observe("host", BLOCK_BYTES, 1.0)  # measured: a second to load a block
    assert not tiers.load(b"h1", 2) and not cache[:, 2].any(), "recomputed: nothing loaded"
    assert host.stats().hits == host.stats().misses == 0, "the host tier was not asked"
    prefill.tokens_per_s = 1.0  # now recomputing takes 2 s a block
    assert tiers.load(b"h1", 2) and torch.equal(cache[:, 2], cache[:, 1])
    assert host.stats().hits == 1
    assert tiers.cost.rates()[0].bytes_per_s > BLOCK_BYTES, "the real load, measured"

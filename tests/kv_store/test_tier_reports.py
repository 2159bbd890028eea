"""What a node reports of its tiers for tier-aware routing (issue 40): the host tier's blocks by
change since the last report (whole at first, after an overflow, or when asked), and the blocks
put into the shared store and those found gone from it (a miss, an eviction sweep). The
router's side is tests/router/test_kv_tier_routing.py."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.kv_store import FileTier, HostTier, TierChain
from pdserve.kv_store.cost import LoadCost, PrefillCost
from pdserve.kv_store.key import KeySpace
from pdserve.kv_store.pool_tiers import PoolTiers

SPACE = KeySpace("ab" * 32)
SHAPE = (2, 8, 4, 4)  # planes, blocks, then one block's page
BLOCK_BYTES = 2 * 4 * 4 * 4  # float32


def tiers(store: Path | None, host_blocks: int = 2) -> PoolTiers:
    chain = [HostTier(host_blocks * BLOCK_BYTES)]
    if store is not None:
        chain.append(FileTier(store))
    cost = LoadCost(PrefillCost(), policy="always")
    return PoolTiers(TierChain(chain), SPACE, [torch.zeros(SHAPE)], 4, cost)


def evict(t: PoolTiers, *blocks: int) -> None:
    """The pool evicts `blocks` (each its own one-byte hash) and fences, as the engine's step
    does before the forward that reuses them."""
    for i in blocks:
        t.offload(bytes([i]), i)
    t.fence()


def test_the_host_tier_is_reported_whole_then_by_change(tmp_path: Path) -> None:
    t = tiers(tmp_path)
    evict(t, 1, 2, 3)  # the host tier keeps two: 1 left it
    reset, joined, left = t.host_changes(snapshot=False)
    assert reset and set(joined) == {b"\x02", b"\x03"} and left == (), "first: the whole tier"
    evict(t, 4)  # pushes 2 out
    assert t.host_changes(snapshot=False) == (False, (b"\x04",), (b"\x02",))
    assert t.host_changes(snapshot=False) == (False, (), ())
    reset, joined, _ = t.host_changes(snapshot=True)
    assert reset and set(joined) == {b"\x03", b"\x04"}, "asked: the whole tier again"


def test_store_writes_are_reported_once(tmp_path: Path) -> None:
    t = tiers(tmp_path)
    evict(t, 1, 2, 3)
    assert t.take_shared_changes() == ((b"\x01", b"\x02", b"\x03"), ())
    assert t.take_shared_changes() == ((), ())
    assert t.store_id == f"file://{tmp_path}#{SPACE.namespace}"
    assert t.store_id != tiers(tmp_path / "other").store_id


def test_a_node_without_a_store_reports_no_store_writes() -> None:
    t = tiers(None)
    evict(t, 1)
    assert t.take_shared_changes() == ((), ()) and t.store_id == ""


def test_the_store_writes_kept_are_bounded(tmp_path: Path) -> None:
    t = tiers(tmp_path)
    t.shared_limit = 2
    evict(t, 1, 2, 3)
    assert t.take_shared_changes() == ((b"\x02", b"\x03"), ()), "the oldest dropped"


def test_store_misses_and_sweep_evictions_are_reported_as_gone(tmp_path: Path) -> None:
    t = tiers(tmp_path, host_blocks=1)
    store = t.store
    assert isinstance(store, FileTier)
    evict(t, 1, 2, 3)
    t.take_shared_changes()
    assert not t.load(b"\x09", 5, 0), "never stored: the store misses it"
    assert t.load(b"\x01", 5, 0), "the host tier lost it, the store has it"
    store.high_bytes, store.low_bytes = 1, 0  # the next sweep evicts everything
    assert store.sweep() == 0
    # No watermark again: the next put would start a background sweep that may take 4 too.
    store.high_bytes, store.low_bytes = None, None
    evict(t, 4)
    stored, removed = t.take_shared_changes()
    assert stored == (b"\x04",)
    assert set(removed) == {b"\x09", b"\x01", b"\x02", b"\x03"}, "the miss and the sweep"
    assert not t.load(b"\x02", 5, 0)  # host: only 4; store: swept
    assert t.take_shared_changes() == ((), (b"\x02",))

"""Tier-aware routing (issue 40): the router credits a node's cached prompt blocks by the
medium holding them (device pool > host tier > shared store, `TierCredit`) in prefix-aware
placement and in the local/remote prefill choice, learns them from heartbeats, never counts a
block a node may no longer hold (a gap, a restart), and sums the nodes' tier counters.
The end-to-end test is tests/e2e/test_kv_tiers_routing.py."""

from __future__ import annotations

import pytest

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.wire.messages import Heartbeat, RegisterNode
from pdserve.common.wire.payloads import TierCounts
from pdserve.router.cluster.registry import NodeRegistry, TierCredit
from pdserve.router.cluster.routing import PlacementConfig, estimate, missing_tokens, prefix_aware
from pdserve.router.cluster.streams import BlockHashes

BS = 16
PROMPT = list(range(1, 161))  # 10 blocks
TOKENS = BlockHashes(PROMPT)
HASHES = hash_token_blocks(PROMPT, BS)
STORE = "file:///kv#space"


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(credit: TierCredit | None = None) -> NodeRegistry:
    return NodeRegistry(5.0, 4096, Clock(), credit)


def join(reg: NodeRegistry, name: str, role: str = "prefill", store: str = "") -> None:
    msg = RegisterNode(name, role, (), "zmq", "", 256, BS, 4096, incarnation=name, kv_store=store)
    reg.add(name, msg, reg.clock())


def heartbeat(reg: NodeRegistry, name: str, seq: int, **fields) -> bool:
    """Apply one heartbeat of `name` numbered `seq` (a snapshot when prefix_reset)."""
    msg = Heartbeat(name, 256, 0, 0, 0, prefix_seq=seq, **fields)
    return reg.get(name).apply_heartbeat(msg, reg.clock())


def order(reg: NodeRegistry) -> list[str]:
    return [n.node_id for n in prefix_aware(reg.routable(("prefill",)), TOKENS)]


def test_device_beats_host_beats_shared_beats_none() -> None:
    reg = registry()
    for name in ("none", "shared", "host", "device"):
        join(reg, name, store=STORE if name == "shared" else "")
        heartbeat(reg, name, 1, prefix_reset=True)
    heartbeat(reg, "device", 2, prefix_stored=tuple(HASHES))
    heartbeat(reg, "host", 2, host_stored=tuple(HASHES))
    join(reg, "writer", role="decode", store=STORE)  # another node of the store wrote them
    heartbeat(reg, "writer", 1, prefix_reset=True, shared_stored=tuple(HASHES))
    assert order(reg) == ["device", "host", "shared", "none"]
    now = reg.clock()
    got = {n: missing_tokens(reg.get(n), TOKENS, now) for n in ("device", "host", "shared")}
    # defaults: a host block costs 0.1 of computing it, a store block 0.5
    assert got == {"device": 0, "host": 16, "shared": 80}
    assert missing_tokens(reg.get("none"), TOKENS, now) == len(PROMPT)


def test_credit_counts_leading_blocks_up_to_the_first_missing_one() -> None:
    reg = registry(TierCredit(host_cost=0.25, shared_cost=0.5))
    join(reg, "p", store=STORE)
    heartbeat(reg, "p", 1, prefix_reset=True, prefix_stored=tuple(HASHES[:2]))
    heartbeat(reg, "p", 2, host_stored=tuple(HASHES[2:4]), shared_stored=tuple(HASHES[4:5]))
    heartbeat(reg, "p", 3, host_stored=tuple(HASHES[6:]))  # after a gap in the chain: useless
    credited = 2 * BS + 2 * BS * 0.75 + BS * 0.5
    assert missing_tokens(reg.get("p"), TOKENS, reg.clock()) == len(PROMPT) - credited


def test_a_load_cost_of_one_or_more_credits_nothing() -> None:
    reg = registry(TierCredit(host_cost=1.0, shared_cost=3.0))
    join(reg, "p", store=STORE)
    heartbeat(reg, "p", 1, prefix_reset=True, host_stored=tuple(HASHES[:5]))
    heartbeat(reg, "p", 2, shared_stored=tuple(HASHES[5:]))
    assert missing_tokens(reg.get("p"), TOKENS, reg.clock()) == len(PROMPT)


def test_bad_credits_are_refused() -> None:
    with pytest.raises(ValueError, match="host_cost"):
        TierCredit(host_cost=-0.1)
    with pytest.raises(ValueError, match="shared_cost"):
        TierCredit(shared_cost=float("inf"))


def test_the_store_credit_goes_only_to_nodes_of_that_store() -> None:
    reg = registry()
    join(reg, "a", store=STORE)
    join(reg, "b", store="redis://other:6379/0#space")
    join(reg, "c")
    heartbeat(reg, "a", 1, prefix_reset=True, shared_stored=tuple(HASHES))
    for name in ("b", "c"):
        heartbeat(reg, name, 1, prefix_reset=True)
    join(reg, "a2", store=STORE)  # joins later: the store still holds what "a" wrote
    now = reg.clock()
    assert missing_tokens(reg.get("a2"), TOKENS, now) == len(PROMPT) // 2
    assert missing_tokens(reg.get("b"), TOKENS, now) == len(PROMPT)
    assert missing_tokens(reg.get("c"), TOKENS, now) == len(PROMPT)


def test_the_store_view_forgets_blocks_a_node_found_gone() -> None:
    """A node of the store reports the blocks it missed there or swept out (`shared_removed`):
    no node of that store is credited them any more, and a block written again is."""
    reg = registry()
    for name in ("writer", "reader", "other"):
        join(reg, name, store=STORE)
    heartbeat(reg, "writer", 1, prefix_reset=True, shared_stored=tuple(HASHES))
    heartbeat(reg, "other", 1, prefix_reset=True)
    assert missing_tokens(reg.get("other"), TOKENS, reg.clock()) == len(PROMPT) // 2
    heartbeat(reg, "reader", 1, prefix_reset=True, shared_removed=tuple(HASHES[4:]))
    now = reg.clock()
    assert missing_tokens(reg.get("other"), TOKENS, now) == len(PROMPT) - 4 * BS * 0.5
    assert missing_tokens(reg.get("writer"), TOKENS, now) == len(PROMPT) - 4 * BS * 0.5
    heartbeat(reg, "writer", 2, shared_stored=tuple(HASHES[4:6]))  # written again
    expected = len(PROMPT) - 6 * BS * 0.5
    assert missing_tokens(reg.get("other"), TOKENS, reg.clock()) == expected


def test_a_gap_forgets_the_host_view_and_a_snapshot_replaces_it() -> None:
    reg = registry()
    join(reg, "p")
    heartbeat(reg, "p", 1, prefix_reset=True, host_stored=tuple(HASHES))
    node = reg.get("p")
    assert node.host_prefixes == set(HASHES)
    assert heartbeat(reg, "p", 2, host_removed=tuple(HASHES[5:])) is True
    assert node.host_prefixes == set(HASHES[:5])
    assert heartbeat(reg, "p", 4, host_stored=tuple(HASHES)) is False, "a lost delta"
    assert node.host_prefixes == set() and missing_tokens(node, TOKENS, reg.clock()) == 160
    heartbeat(reg, "p", 5, prefix_reset=True, host_stored=tuple(HASHES[:3]))
    assert node.host_prefixes == set(HASHES[:3]), "the snapshot is the whole view"


def test_a_restarted_node_is_credited_nothing_it_held_before() -> None:
    reg = registry()
    join(reg, "p")
    heartbeat(reg, "p", 1, prefix_reset=True, prefix_stored=tuple(HASHES[:2]))
    heartbeat(reg, "p", 2, host_stored=tuple(HASHES[2:]))
    assert missing_tokens(reg.get("p"), TOKENS, reg.clock()) < len(PROMPT)
    join(reg, "p")  # registers again: a new process, empty pool and host tier
    assert missing_tokens(reg.get("p"), TOKENS, reg.clock()) == len(PROMPT)


def test_local_or_remote_prefill_credits_the_decode_nodes_host_tier() -> None:
    reg = registry()
    join(reg, "d", role="decode")
    join(reg, "p")
    heartbeat(reg, "p", 1, prefix_reset=True)
    d, p = reg.get("d"), reg.get("p")
    d.prefill_rate = p.prefill_rate = 1000.0
    d.handoff_s = 0.01
    d.inflight = 1  # one request decodes on d: a local prefill costs it twice
    heartbeat(reg, "d", 1, prefix_reset=True)
    est = estimate(PlacementConfig(), d, [p], TOKENS, reg.clock())
    assert not est.local and est.missing_decode == 160
    heartbeat(reg, "d", 2, host_stored=tuple(HASHES))  # the conversation's blocks, on host
    est = estimate(PlacementConfig(), d, [p], TOKENS, reg.clock())
    assert est.local and est.missing_decode == 16 and est.missing_prefill == 160


def test_tier_counters_are_summed_over_live_nodes() -> None:
    reg = registry()
    for name in ("a", "b", "c"):
        join(reg, name)
    host = TierCounts("host", hits=3, misses=1, loaded_bytes=300, load_seconds=0.25)
    store = TierCounts("file", hits=2, stored_bytes=900, errors=1, recompute_chosen=4)
    heartbeat(reg, "a", 1, kv_tiers=(host, store), kv_tier_loaded_tokens=40)
    heartbeat(reg, "b", 1, kv_tiers=(host,), kv_tier_loaded_tokens=24)
    heartbeat(reg, "c", 1)  # no tiers
    stats = reg.stats()
    assert stats["kv_tier_hits_host"] == 6 and stats["kv_tier_misses_host"] == 2
    assert stats["kv_tier_loaded_bytes_host"] == 600
    assert stats["kv_tier_load_seconds_host"] == pytest.approx(0.5)
    assert stats["kv_tier_hits_file"] == 2 and stats["kv_tier_stored_bytes_file"] == 900
    assert stats["kv_tier_errors_file"] == 1 and stats["kv_tier_recompute_chosen_file"] == 4
    assert stats["kv_tier_loaded_tokens"] == 64
    heartbeat(reg, "a", 2)  # its tiers' counters are the latest report's, not added up
    assert reg.stats()["kv_tier_hits_host"] == 3 and "kv_tier_hits_file" not in reg.stats()

"""The eviction's copy-out happens at a fence, not inside the scheduler's call (issue 40): a
block the pool evicts is only marked, and its pages are copied to the tiers, all the step's
blocks at once, before anything writes into a block (the step's forward, a tier load into the
block, another node's pages arriving in a reservation). Each test reuses an evicted block and
writes into it, and reads the evicted block back from a tier (the store's checksum verified):
its bytes must be the pages it held before, never the new ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.engine.kv_cache_manager import KVCacheManager, hash_token_blocks
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.engine.request import Request
from pdserve.kv_store import HostTier, TierChain
from pdserve.kv_store.cost import LoadCost, PrefillCost
from pdserve.kv_store.pool_tiers import PoolTiers
from pdserve.tiny_model import make_tiny_model
from tests.kv_store.helpers import SPACE

BS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def pages(caches: list[torch.Tensor], block_id: int) -> bytes:
    """A block's payload as the tiers store it: its pages in every layer cache, in order."""
    return b"".join(c[:, block_id].contiguous().view(torch.uint8).numpy().tobytes() for c in caches)


# -- through the engine: the forward that reuses an evicted block ----------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("fence"), vocab=512))


def test_a_block_evicted_and_rewritten_in_one_step_lands_intact(
    model_dir: str, tmp_path: Path
) -> None:
    """Prompt A's blocks are evicted by prompt B's allocation and written by B's forward in
    the same step; the host tier and the file store then hold A's pages as A's step wrote
    them, and a second engine loading A from the store answers as the first computed it.
    The store's writer is held during each forward (`WriteBehind.hold`)."""
    url = f"file://{tmp_path / 'store'}"
    llm = LLM(model_dir, num_blocks=16, block_size=BS, dtype="float32",
              skip_tokenizer_init=True, kv_offload_bytes=1 << 24, kv_store=url)  # fmt: skip
    a, b = list(range(10, 50)), list(range(100, 156))  # 10 and 14 blocks of a 15-block pool
    (first,) = llm.generate([a], GREEDY)
    engine = llm.engine
    caches, cached = engine.runner.kv_caches, engine.kv.pool.cached
    hashes = hash_token_blocks(a, BS)[: (len(a) - 1) // BS]
    before = {h: pages(caches, cached[h].block_id) for h in hashes}
    llm.generate([b], GREEDY)  # one prefill step: evicts every block of A and writes them
    assert not set(hashes) & set(cached), "B's step reused every block A had"
    engine.tiers.fence()  # the next step's fence: it must find nothing left of B's step
    assert engine.tiers.chain.flush(30.0)
    host, store = engine.tiers.chain.tiers
    for h in hashes:
        assert bytes(host.get(engine.tiers.space.key(h))) == before[h], "host tier: other pages"
        assert bytes(store.get(engine.tiers.space.key(h))) == before[h], "store: other pages"
    held = []
    execute = engine.runner.execute
    behind = engine.tiers.chain.behind[store.name]

    def watched(*args, **kwargs):
        held.append(behind._held)
        return execute(*args, **kwargs)

    engine.runner.execute = watched  # type: ignore[method-assign]
    llm.generate([a], GREEDY)
    assert held and all(held) and not behind._held, "the writer is held during each forward"
    llm.close()
    again = LLM(model_dir, num_blocks=16, block_size=BS, dtype="float32",
                skip_tokenizer_init=True, kv_store=url)  # fmt: skip
    (second,) = again.generate([a], GREEDY)
    assert again.engine.kv.stats.tier_hits == len(hashes) * BS
    assert second.token_ids == first.token_ids
    again.close()


# -- through the manager: a load into an evicted block, a reservation ------------------------


class Pool:
    """A manager over one small layer cache and a host tier, and a stand-in "forward" that
    writes a block's pages (every element the writer's number)."""

    def __init__(self, num_blocks: int = 7) -> None:
        self.cache = torch.zeros(2, num_blocks, BS, 8)
        self.host = HostTier(1 << 20)
        chain = TierChain([self.host])
        cost = LoadCost(PrefillCost(), "always")
        self.tiers = PoolTiers(chain, SPACE, [self.cache], BS, cost)
        self.kv = KVCacheManager(num_blocks, BS, tiers=self.tiers)

    def write(self, block_ids: list[int], value: float) -> None:
        for block_id in block_ids:
            self.cache[:, block_id] = value

    def prefill(self, rid: str, tokens: list[int], value: float) -> Request:
        """Look the prompt up, allocate, fence and "run" its forward (as `LLMEngine.run`),
        then free it: its computed blocks stay cached and evictable."""
        r = Request(rid, tokens, GREEDY)
        hits, n = self.kv.get_computed_blocks(r)
        new = self.kv.allocate_slots(r, r.num_tokens - n, hits)
        assert new is not None
        self.kv.fence()
        self.write(new.block_ids, value)
        r.num_computed_tokens = r.num_tokens
        self.kv.free(r)
        return r

    def stored(self, tokens: list[int]) -> list[bytes | None]:
        out = []
        for h in hash_token_blocks(tokens, BS):
            got = self.host.get(SPACE.key(h))
            out.append(None if got is None else bytes(got))
        return out


def page_bytes(value: float) -> bytes:
    return torch.full((2, BS, 8), value).view(torch.uint8).numpy().tobytes()


def test_a_load_into_a_block_evicted_for_it_stores_the_evicted_pages_first() -> None:
    """A's blocks are evicted by B's and written down; A again loads its blocks back from
    the host tier into blocks it evicts from B as it goes: B's blocks reach the host tier
    with B's pages, not the A pages loaded over them."""
    p = Pool()  # 6 usable blocks
    a, b = list(range(100, 121)), list(range(200, 221))  # 5 full blocks each
    p.prefill("a1", a, 1.0)
    p.prefill("b1", b, 2.0)  # evicts A's five blocks: their pages go down at the fence
    assert p.stored(a)[:5] == [page_bytes(1.0)] * 5
    p.prefill("a2", a, 3.0)  # loads A's blocks into B's, evicting them
    assert p.kv.stats.tier_hits == 20
    assert p.stored(b)[:5] == [page_bytes(2.0)] * 5, "an evicted block's pages were loaded over"
    p.kv.check_integrity()


def test_a_reserved_block_is_fenced_before_another_nodes_pages_arrive() -> None:
    """A decode node's reservation (`cache=False`) hands its blocks to a transfer that may
    write them at once, without a step in between: the blocks it evicted are copied out
    before `allocate_slots` returns."""
    p = Pool()
    a, b = list(range(100, 121)), list(range(200, 221))
    p.prefill("a1", a, 1.0)
    r = Request("b1", b, GREEDY)
    new = p.kv.allocate_slots(r, r.num_tokens, cache=False)
    assert new is not None
    p.write(new.block_ids, 5.0)  # the prefill node's pages land, no fence of the engine's
    assert p.stored(a)[:5] == [page_bytes(1.0)] * 5


def test_eviction_marks_and_the_fence_copies_every_marked_block_at_once() -> None:
    """Nothing reaches a tier until the fence; the fence stores each marked block's pages in
    the payload layout (every cache's pages in order, whatever its dtype and planes) with
    one gather per cache; `close` fences what is still marked."""
    caches = [torch.randn(2, 6, BS, 8), torch.randn(1, 6, BS, 3).to(torch.bfloat16)]
    host = HostTier(1 << 20)
    tiers = PoolTiers(TierChain([host]), SPACE, caches, BS, LoadCost(PrefillCost(), "always"))
    hashes = [bytes([i]) * 16 for i in range(4)]
    want = {h: pages(caches, i + 1) for i, h in enumerate(hashes)}
    gathers = count_index_selects()
    for i, h in enumerate(hashes[:3]):
        tiers.offload(h, i + 1)
    assert len(host) == 0 and tiers.offloaded == 0
    tiers.fence()
    assert gathers() == len(caches), "one gather per cache for the three blocks"
    assert [bytes(host.get(SPACE.key(h))) for h in hashes[:3]] == [want[h] for h in hashes[:3]]
    tiers.offload(hashes[3], 4)
    tiers.close()  # which empties the host tier: its puts tell
    assert tiers.offloaded == 4 and host.stats().puts == 4


def count_index_selects():
    """How many times `torch.Tensor.index_select` ran since this call (read by calling)."""
    calls = [0]
    original = torch.Tensor.index_select

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    torch.Tensor.index_select = counted  # type: ignore[method-assign]

    def read() -> int:
        torch.Tensor.index_select = original  # type: ignore[method-assign]
        return calls[0]

    return read

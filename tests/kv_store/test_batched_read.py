"""A run of blocks read from the store in one round trip (`KVTier.get_run`: a Redis MGET, one
pass over the files), still failing closed per block: a damaged block in the middle of a run
ends it, the blocks before it load and the rest are recomputed, with the engine's output
unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.kv_store import FileTier, HostTier, KVTier, TierChain, open_store
from pdserve.kv_store.redis_tier import PREFIX, RedisTier
from pdserve.tiny_model import make_tiny_model
from tests.kv_store.helpers import RedisServer, key, payload

BLOCK = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 50))  # 10 blocks; the last holds the last token: 9 can be loaded
OTHER = list(range(100, 156))  # 14 blocks: evicts the prompt's from a 16-block pool


def damage(store: KVTier, name: str) -> None:
    """Flip a payload byte of the stored object `name` (only the checksum can tell)."""
    if isinstance(store, RedisTier):
        blob = bytearray(store._client.get(PREFIX + name))
        blob[-9] ^= 0x40
        store._client.set(PREFIX + name, bytes(blob))
    else:
        assert isinstance(store, FileTier)
        path = store.path(name)
        blob = bytearray(path.read_bytes())
        blob[-9] ^= 0x40
        path.write_bytes(blob)


def count_round_trips(store: KVTier) -> dict[str, int]:
    """Counts the store's reads: batched (`_load_many`) and one block each (`_load`)."""
    calls = {"many": 0, "one": 0}
    load_many, load = store._load_many, store._load

    def many(names):
        calls["many"] += 1
        return load_many(names)

    def one(name):
        calls["one"] += 1
        return load(name)

    store._load_many, store._load = many, one  # type: ignore[method-assign]
    return calls


@pytest.fixture(params=["file", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}"
        return
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_run_stops_at_its_first_damaged_block(backend: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path) if backend == "redis" else None
    if server is not None:
        server.start()
    try:
        tier = open_store(server.url if server else f"file://{tmp_path}")
        for i in range(6):
            assert tier.put(key(i), payload(i))
        damage(tier, key(3).name)
        calls = count_round_trips(tier)
        run = tier.get_run([key(i) for i in range(6)])
        assert [bytes(p) for p in run] == [payload(i) for i in range(3)]
        assert calls == {"many": 1, "one": 0}, "one round trip for the run"
        s = tier.stats()
        assert (s.hits, s.misses, s.bad_objects) == (3, 1, 1), "after the damaged one: uncounted"
        assert tier.get_run([key(9), key(0)]) == [], "a run starting with a miss is empty"
        tier.close()
    finally:
        if server is not None:
            server.kill()


def test_a_run_stops_before_a_block_the_host_tier_serves(tmp_path: Path) -> None:
    import torch

    from pdserve.kv_store.cost import LoadCost, PrefillCost
    from pdserve.kv_store.pool_tiers import PoolTiers
    from tests.kv_store.helpers import SPACE

    cache = torch.zeros(2, 16, 4, 8)  # [planes, blocks, ...]: 1 KiB a block
    host, store = HostTier(1 << 20), FileTier(tmp_path)
    tiers = PoolTiers(TierChain([host, store]), SPACE, [cache], BLOCK, LoadCost(PrefillCost()))
    hashes = [f"b{i}".encode() for i in range(6)]
    for i, h in enumerate(hashes):
        cache[:, i] = i + 1
        store.put(SPACE.key(h), memoryview(cache[:, i].contiguous().numpy()).cast("B"))
    host.put(SPACE.key(hashes[4]), memoryview(cache[:, 4].contiguous().numpy()).cast("B"))
    cache.zero_()
    calls = count_round_trips(store)
    tiers.begin_walk(0, 6, hashes)
    assert all(tiers.load(h, 8 + i, i) for i, h in enumerate(hashes))
    assert all(bool((cache[:, 8 + i] == i + 1).all()) for i in range(6))
    assert calls == {"many": 2, "one": 0}, "blocks 0-3 in one trip, then 5"
    assert store.stats().hits == 5 and host.stats().hits == 1


def run(model_dir: str, store_url: str, prompt: list[int]) -> tuple[list[int], LLM]:
    llm = LLM(
        model_dir,
        num_blocks=16,
        block_size=BLOCK,
        dtype="float32",
        skip_tokenizer_init=True,
        kv_store=store_url,
    )
    (out,) = llm.generate([prompt], GREEDY)
    return list(out.token_ids), llm


def test_a_damaged_block_mid_run_loads_the_blocks_before_it(tmp_path: Path, store_url: str) -> None:
    model_dir = str(make_tiny_model("llama", tmp_path / "model", vocab=512))
    want, first = run(model_dir, store_url, PROMPT)
    first.generate([OTHER], GREEDY)  # evicts the prompt's blocks: written to the store
    first.engine.close()
    second = LLM(model_dir, num_blocks=16, block_size=BLOCK, dtype="float32",
                 skip_tokenizer_init=True, kv_store=store_url)  # fmt: skip
    tiers = second.engine.tiers
    assert tiers is not None and tiers.store is not None
    keys = [tiers.space.key(h) for h in hash_token_blocks(PROMPT, BLOCK)[:9]]
    assert all(tiers.store.contains(k) for k in keys), "the first engine stored the prompt"
    damage(tiers.store, keys[4].name)
    calls = count_round_trips(tiers.store)
    (out,) = second.generate([PROMPT], GREEDY)
    assert list(out.token_ids) == want, "the same tokens as computing the whole prompt"
    kv, s = second.engine.kv, tiers.store.stats()
    assert kv.stats.tier_hits == 4 * BLOCK, "blocks 0-3 loaded, 4 on recomputed"
    assert (s.hits, s.misses, s.bad_objects) == (4, 1, 1)
    assert calls == {"many": 1, "one": 0}, "the run read in one round trip"
    kv.check_integrity()
    assert kv.num_free_blocks == 15 and not kv.req_blocks
    second.engine.close()

"""KV tiers under the engine's block pool (issue 40, colocated): a multi-turn workload whose
working set is about 4x a 16-block pool, with the host tier alone and with host + file://
store, equals HF transformers' greedy output token for token, and the tiers' counters show the
blocks the pool evicted coming back instead of being recomputed. A store whose every object
is corrupted gives the same output, its reads counted as misses."""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.engine.kv_cache_manager import TierLoads
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.node.stages import NodeMetrics
from pdserve.common.node.tier_metrics import tier_report
from pdserve.kv_store import FileTier, KeySpace, codec
from pdserve.tiny_model import make_tiny_model
from tests.kv_store.helpers import redis_server  # noqa: F401  (the fixture)

VOCAB = 512
BLOCK = 4
NUM_BLOCKS = 16  # 15 usable: 60 tokens, a fifth of the workload's 5 conversations
ANSWER = 6
GREEDY = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
Turn = tuple[tuple[int, ...], tuple[int, ...]]  # (prompt, answer)
Between = Callable[[int], None] | None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiers"), vocab=VOCAB))


def converse(llm: LLM, between: Between = None, n_convs: int = 5, n_turns: int = 4) -> list[Turn]:
    """Round robin over conversations, one request at a time: each turn's prompt is the
    previous prompt, its answer and six new tokens, so a turn's prefix was evicted by the
    other conversations' turns since (about 68 blocks of history against 15). `between(i)`
    runs after the i-th request (a fault injected under load)."""
    rng = random.Random(7)
    history: list[list[int]] = [[] for _ in range(n_convs)]
    turns: list[Turn] = []
    for _ in range(n_turns):
        for conv in history:
            conv += [rng.randrange(3, VOCAB) for _ in range(12 if not conv else 6)]
            (out,) = llm.generate([conv], GREEDY)
            turns.append((tuple(conv), tuple(out.token_ids)))
            conv += out.token_ids
            if between is not None:
                between(len(turns))
    return turns


_hf: dict[tuple[int, ...], tuple[int, ...]] = {}


def assert_equals_hf(model_dir: str, turns: list[Turn]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, answer in turns:
        if prompt not in _hf:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=ANSWER,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            _hf[prompt] = tuple(out[0, len(prompt) :].tolist())
        assert answer == _hf[prompt], f"prompt of {len(prompt)} tokens"


def run(
    model_dir: str,
    between: Between = None,
    prepare: Callable[[LLM], None] | None = None,
    kv_load_policy: str = "always",
    **tiers: object,
) -> tuple[list[Turn], LLM]:
    """The workload on a fresh engine with `tiers`. The tests count loads, and on this tiny
    model recomputing a block is about as fast as reading it: they load every hit (`always`)
    unless they test the cost policy, the default."""
    llm = LLM(
        model_dir,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        dtype="float32",
        skip_tokenizer_init=True,
        kv_load_policy=kv_load_policy,
        **tiers,
    )
    if prepare is not None:
        prepare(llm)
    turns = converse(llm, between)
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == NUM_BLOCKS - 1 and not kv.req_blocks  # back to baseline
    return turns, llm


def tier(llm: LLM, name: str):
    """The counters of the tier `name` ("host", or a store by its URL's scheme)."""
    (stats,) = [s for s in llm.engine.tier_stats() if s.tier.split(":")[0] == name]
    return stats


def loaded_blocks(llm: LLM, stats) -> int:
    """The blocks a store tier gave the pool: its hits, and the reads its write-behind queue
    answered (blocks this engine wrote down that were not in the store yet: a loaded machine's
    writer is behind, and the tier's own counters never see them)."""
    behind = llm.engine.tiers.chain.behind.get(stats.tier)
    return stats.hits + (behind.served if behind is not None else 0)


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> tuple[list[Turn], int]:
    """The workload without tiers: its turns (checked against HF) and prefix-cache hits."""
    turns, llm = run(model_dir)
    assert_equals_hf(model_dir, turns)
    assert llm.engine.tier_stats() == () and llm.engine.kv.stats.tier_hits == 0
    assert scrape(llm)[("pdserve:kv_tier_loaded_tokens_total", "")] == 0
    return turns, llm.engine.kv.stats.hits


def test_host_tier_equals_hf_and_saves_prompt_tokens(model_dir: str, baseline) -> None:
    turns, llm = run(model_dir, kv_offload_bytes=64 << 20)
    assert turns == baseline[0]
    assert_equals_hf(model_dir, turns)
    stats, host = llm.engine.kv.stats, tier(llm, "host")
    assert llm.engine.tiers is not None and llm.engine.tiers.offloaded > 0
    # Every earlier turn's history comes back from the host tier instead of being recomputed.
    assert host.hits > 0 and stats.tier_hits == host.hits * BLOCK
    assert stats.hits == baseline[1] + stats.tier_hits
    assert host.bytes_read == host.hits * llm.engine.tiers.block_bytes
    metrics = scrape(llm)  # 0 on the tierless baseline engine
    assert metrics[("pdserve:kv_tier_loaded_tokens_total", "")] == stats.tier_hits
    assert metrics[("pdserve:kv_tier_hits_total", "host")] == host.hits
    assert metrics[("pdserve:kv_tier_stored_bytes_total", "host")] == host.bytes_written > 0


@pytest.fixture(scope="module")
def filled(model_dir: str, baseline, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A file store the workload filled (host tier + file://), checked, and the filling
    engine's prefix hits; tests that change the store read a copy."""
    folder = tmp_path_factory.mktemp("filled") / "kv"
    turns, first = run(model_dir, kv_offload_bytes=64 << 20, kv_store=f"file://{folder}")
    assert turns == baseline[0] and tier(first, "host").hits > 0
    assert tier(first, "file").puts > 0
    return folder, first.engine.kv.stats.hits


def copy_of(store: Path, tmp_path: Path) -> Path:
    shutil.copytree(store, tmp_path / "kv")
    return tmp_path / "kv"


def test_file_store_serves_a_fresh_engine(model_dir: str, baseline, filled) -> None:
    # A second engine (an empty pool and host tier) reads what the first stored.
    turns, second = run(model_dir, kv_offload_bytes=64 << 20, kv_store=f"file://{filled[0]}")
    assert turns == baseline[0]
    assert_equals_hf(model_dir, turns)
    file_hits = tier(second, "file").hits
    assert file_hits > 0 and tier(second, "file").bad_objects == 0
    assert second.engine.kv.stats.tier_hits >= file_hits * BLOCK
    assert second.engine.kv.stats.hits > filled[1]  # turn 1s hit too


def test_cost_policy_recomputes_what_a_slow_tier_holds(model_dir: str, baseline, filled) -> None:
    """--kv-load-policy cost with a store that takes 0.5 s a read (and is known to: its rate
    seeded) and a prefill rate measured by a 40-token prompt first: the engine stops asking
    the store and recomputes instead (one probe in 32 still loads), and the answers stay HF's."""

    def slow_store(llm: LLM) -> None:
        tiers = llm.engine.tiers
        store = tiers.chain.tiers[-1]
        read = store._load
        store._load = lambda name: time.sleep(0.5) or read(name)  # type: ignore[method-assign]
        tiers.cost.observe(store.name, tiers.block_bytes, 1.0)
        llm.generate([[2 + i for i in range(40)]], GREEDY)  # the prefill rate, measured

    url = f"file://{filled[0]}"
    turns, llm = run(model_dir, prepare=slow_store, kv_store=url, kv_load_policy="cost")
    assert turns == baseline[0]
    (rate,) = llm.engine.tiers.cost.rates()
    got = tier(llm, "file")
    assert llm.engine.prefill_rate.tokens_per_s > 0 and rate.recompute_chosen > 0
    assert llm.engine.kv.stats.tier_hits == loaded_blocks(llm, got) * BLOCK
    assert scrape(llm)[("pdserve:kv_tier_recompute_chosen_total", "file")] == rate.recompute_chosen


def damage(path: Path, how: str) -> None:
    """Truncate the object, flip one payload byte (only the checksum can tell), or rewrite it
    as the same block of another KV layout."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "corrupt":
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        other = KeySpace("0" * 64).key(bytes.fromhex(path.stem))
        n_header = codec._PREFIX.unpack_from(data)[2]
        path.write_bytes(codec.encode(other, data[codec._PREFIX.size + n_header :]))


def test_damaged_store_is_recomputed(model_dir: str, baseline, filled, tmp_path: Path) -> None:
    """A third of the objects truncated, a third corrupted, a third of another layout."""
    store = copy_of(filled[0], tmp_path)
    objects = sorted(store.rglob("*.kv"))
    assert len(objects) >= 30
    for i, path in enumerate(objects):
        damage(path, ("truncate", "corrupt", "layout")[i % 3])
    turns, llm = run(model_dir, kv_store=f"file://{store}")
    assert turns == baseline[0]
    assert_equals_hf(model_dir, turns)
    got = tier(llm, "file")
    assert got.bad_objects > 0 and got.misses >= got.bad_objects and got.errors == 0
    # Whatever came back was rewritten by this engine after the damaged object was dropped.
    assert llm.engine.kv.stats.tier_hits == loaded_blocks(llm, got) * BLOCK
    assert scrape(llm)[("pdserve:kv_tier_bad_objects_total", "file")] == got.bad_objects


def test_eviction_while_the_engine_reads(model_dir: str, baseline, filled, tmp_path: Path) -> None:
    """Another sweeper evicts the store down to a few blocks over and over while a fresh
    engine reads it: reads get whole objects or misses, never an error or a bad object."""
    store = copy_of(filled[0], tmp_path)
    assert len(list(store.rglob("*.kv"))) > 40
    sweeper = FileTier(store, high_bytes=20 * _block_bytes(store), low_fraction=0.25)
    stop, sweeps = threading.Event(), []

    def evict() -> None:
        while not stop.is_set():
            sweeps.append(sweeper.sweep())

    thread = threading.Thread(target=evict, daemon=True)
    thread.start()
    try:
        turns, llm = run(model_dir, kv_store=f"file://{store}")
    finally:
        stop.set()
        thread.join(timeout=30)
    assert turns == baseline[0]
    got = tier(llm, "file")
    assert got.bad_objects == 0 and got.errors == 0
    assert min(sweeps) <= 20 * _block_bytes(store), "the sweeper evicted"


def _block_bytes(store: Path) -> int:
    return max(p.stat().st_size for p in store.rglob("*.kv"))


def test_redis_store_with_host_tier_then_alone(model_dir: str, baseline, redis_server) -> None:  # noqa: F811
    turns, first = run(model_dir, kv_offload_bytes=64 << 20, kv_store=redis_server.url)
    assert turns == baseline[0]
    assert tier(first, "host").hits > 0 and tier(first, "redis").puts > 0
    # A fresh engine on the store alone: the store serves every earlier turn's history.
    turns, second = run(model_dir, kv_store=redis_server.url)
    assert turns == baseline[0]
    assert_equals_hf(model_dir, turns)
    got = tier(second, "redis")
    assert got.hits > 0 and got.bad_objects == got.errors == 0
    assert second.engine.kv.stats.tier_hits == loaded_blocks(second, got) * BLOCK
    metrics = scrape(second)
    assert metrics[("pdserve:kv_tier_hits_total", "redis")] == got.hits
    loaded = metrics[("pdserve:kv_tier_loaded_tokens_total", "")]
    assert loaded == loaded_blocks(second, got) * BLOCK
    assert metrics[("pdserve:kv_tier_loaded_bytes_total", "redis")] == got.bytes_read > 0
    assert metrics[("pdserve:kv_tier_load_bytes_per_second", "redis")] > 0


def test_redis_killed_and_restarted_under_load(model_dir: str, baseline, redis_server) -> None:  # noqa: F811
    """kill -9 after the 6th request, a fresh (empty) server on the same port after the
    12th: every answer still equals HF's; the dead server's calls are counted errors and
    misses, and the engine stores into the new server."""

    def fault(i: int) -> None:
        if i == 6:
            redis_server.kill()
        elif i == 12:
            redis_server.start()
            # The tier skips a down store for backoff_s (1 s) after its last failed call: on a
            # quiet machine the last 8 requests fit inside it and nothing was stored again.
            time.sleep(1.5)

    turns, llm = run(model_dir, between=fault, kv_store=redis_server.url)
    assert turns == baseline[0]
    got = tier(llm, "redis")
    assert got.errors >= 1 and got.misses > got.errors and got.bad_objects == 0
    assert redis.Redis(port=redis_server.port, socket_timeout=5).dbsize() > 0, "stored again"
    assert scrape(llm)[("pdserve:kv_tier_errors_total", "redis")] == got.errors


def scrape(llm: LLM) -> dict[tuple[str, str], float]:
    """(sample, tier label or "") -> value of the tier series a node would serve for it."""
    metrics = NodeMetrics({"role": "both", "node_id": "n0"})
    metrics.tiers.publish(tier_report(llm.engine))
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, s.labels.get("tier", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class FakeTiers:
    """BlockTiers over a dict, with a pool of "pages" (block id -> hash it holds)."""

    def __init__(self, pages: dict[int, bytes], fail: bool = False) -> None:
        self.pages, self.fail = pages, fail
        self.stored: dict[bytes, bytes] = {}
        self.walks: list[tuple[int, int]] = []
        self.walk = TierLoads()  # records nothing: the manager's per-request record stays empty

    def offload(self, block_hash: bytes, block_id: int) -> None:
        assert self.pages[block_id] == block_hash, "offloaded after the block was reused"
        self.stored[block_hash] = self.pages[block_id]

    def begin_walk(self, first: int, end: int, hashes: object = ()) -> None:
        self.walks.append((first, end))

    def fence(self) -> None:
        pass  # `offload` copied already

    def forward(self) -> AbstractContextManager[None]:
        return nullcontext()

    def load(self, block_hash: bytes, block_id: int, at: int) -> bool:
        assert self.walks and self.walks[-1][0] <= at < self.walks[-1][1], "outside its walk"
        if self.fail or block_hash not in self.stored:
            return False
        self.pages[block_id] = self.stored[block_hash]
        return True


def prefill(kv, pages: dict[int, bytes], rid: str, tokens: list[int]) -> int:
    """Prefill then free a request (as the engine does), writing each full block's "pages";
    returns the tokens its prefix lookup served."""
    from pdserve.common.engine.request import Request
    from pdserve.common.wire.payloads import SamplingParams

    r = Request(rid, tokens, SamplingParams(max_tokens=1))
    hits, n = kv.get_computed_blocks(r)
    for b in hits.blocks:
        assert pages.get(b.block_id) == b.block_hash, "a hit block without its pages"
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    for b in kv.req_blocks[rid]:
        if b.block_hash is not None:
            pages[b.block_id] = b.block_hash
    kv.free(r)
    kv.check_integrity()
    return n


@pytest.mark.parametrize("fail", [False, True])
def test_manager_offloads_evicted_blocks_and_loads_them_back(fail: bool) -> None:
    from pdserve.common.engine.kv_cache_manager import KVCacheManager

    pages: dict[int, bytes] = {}
    tiers = FakeTiers(pages)
    kv = KVCacheManager(num_blocks=7, block_size=4, tiers=tiers)  # 6 usable blocks
    a, b = list(range(100, 121)), list(range(200, 221))  # 5 full blocks each
    assert prefill(kv, pages, "a1", a) == 0
    assert prefill(kv, pages, "b1", b) == 0  # evicts a's blocks: offloaded
    assert len(tiers.stored) >= 5
    tiers.fail = fail
    served = prefill(kv, pages, "a2", a)
    assert served == (0 if fail else 20) and kv.stats.tier_hits == served
    assert tiers.walks[-1] == (0, 5), "one walk over a2's five blocks"
    assert kv.num_free_blocks == 6


def test_bad_tier_options_are_refused_by_name() -> None:
    from pdserve.common.engine.config import CacheConfig

    with pytest.raises(ValueError, match="kv_store 'http://x'"):
        CacheConfig(kv_store="http://x")
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        CacheConfig(kv_offload_bytes=-1)

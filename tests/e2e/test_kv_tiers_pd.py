"""KV tiers through prefill/decode disaggregation (issue 40), on real processes: a router, a
prefill node and a decode node, each with a 16-block pool of 4-token blocks, under a multi-turn
workload whose history is about 4x a pool. Every answer equals HF transformers' greedy output
(float32), and the prefill node's own counters (prefix-cache queries and hits on its /metrics)
say exactly how many prompt tokens it computed:

- host tier alone: each turn's previous prompt comes back from the prefill node's pool or host
  tier; the previous answer (computed on the decode node) is prefilled again;
- host tier and a shared store (file:// or a real redis-server): the decode node writes each
  answer's blocks to the store when it ends (history pull), so the prefill node computes only
  the new message (and the partial block before it);
- a second deployment (fresh nodes, same store) serves each conversation's last prompt: its
  prefill node computes exactly the tokens whose blocks are not in the store.

Every node ends with every block free (its integrity report).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.kv_store.local_redis import LocalRedis
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.tiny_model import make_tiny_model
from tests.common.test_kv_tiers_engine import ANSWER, assert_equals_hf
from tests.e2e.test_disaggregated import assert_clean, complete

VOCAB = 512
BLOCK = 4
ENGINE = ["--block-size", str(BLOCK), "--num-blocks", "16", "--dtype", "float32"]
ENGINE += ["--heartbeat-interval", "0.2"]
ROUTER = ["--prefill-placement", "remote"]  # every prompt through the prefill node
# Loads pinned on: the counters below count what a lookup can load (the cost policy may
# recompute a hit instead).
HOST = ["--kv-offload-bytes", str(64 << 20), "--kv-load-policy", "always"]
Turn = tuple[list[int], list[int]]  # (prompt, answer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiers_pd"), vocab=VOCAB))


class Deployment:
    """A router and one prefill and one decode node with the given tier flags; reads the
    prefill node's prompt tokens computed from its /metrics."""

    def __init__(self, model_dir: str, tiers: list[str], log_dir: Path) -> None:
        self.health = free_port()
        self.cluster = LocalCluster(
            model_dir,
            1,
            1,
            engine_args=ENGINE + tiers,
            router_args=ROUTER,
            node_args={"prefill0": ["--health-port", str(self.health)]},
            log_dir=str(log_dir),
        )
        self.seen = (0.0, 0.0)  # the prefill node's prefix-cache (queries, hits) so far

    def counters(self) -> tuple[float, float]:
        text = httpx.get(f"http://127.0.0.1:{self.health}/metrics", timeout=10).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        name = "pdserve:prefix_cache_{}_total"
        return values[name.format("queries")], values[name.format("hits")]

    def ask(self, prompt: list[int]) -> tuple[list[int], int]:
        """The answer to `prompt` and how many of its tokens the prefill node computed (its
        counters move with the heartbeat: wait until the lookup shows)."""
        answer = complete(self.cluster.url, prompt, max_tokens=ANSWER)["choices"][0]["token_ids"]
        queries, hits = self.seen
        deadline = time.monotonic() + 10
        now = self.counters()
        while now[0] < queries + len(prompt) and time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.counters()
        assert now[0] == queries + len(prompt), "the prefill node looked the prompt up once"
        self.seen = now
        return answer, len(prompt) - int(now[1] - hits)

    def __enter__(self) -> Deployment:
        self.cluster.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                assert_clean(self.cluster)  # every block free on both nodes
        finally:
            self.cluster.__exit__(*exc)


def conversations(n_convs: int, n_turns: int, seed: int):
    """Round robin over conversations, as the colocated tier test: a turn's prompt is the
    previous prompt, its answer and six new tokens; yields (conversation, new tokens)."""
    rng = random.Random(seed)
    for turn in range(n_turns):
        for conv in range(n_convs):
            yield conv, [rng.randrange(3, VOCAB) for _ in range(12 if turn == 0 else 6)]


def full_blocks(n_tokens: int, prompt_len: int) -> int:
    """Tokens in the full blocks among a history's first n_tokens that a prompt of
    prompt_len can take from a cache (never its last token)."""
    return min(n_tokens // BLOCK, (prompt_len - 1) // BLOCK) * BLOCK


def run_conversations(
    d: Deployment, history_pull: bool, n_convs: int = 5, n_turns: int = 4, seed: int = 7
) -> list[Turn]:
    """Every turn equals HF; the prefill node computes exactly what it cannot load: with
    history pull the previous prompt and answer but the answer's last token (never computed),
    without it the previous prompt's full blocks only. Five conversations take about 4x a
    pool: each answer has left the decode node's pool (written down on eviction) before its
    next turn; one conversation alone stays in it."""
    histories: list[list[int]] = [[] for _ in range(n_convs)]
    last: dict[int, Turn] = {}
    turns: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for conv, new in conversations(n_convs, n_turns, seed):
        prompt = histories[conv] + new
        answer, computed = d.ask(prompt)
        turns.append((tuple(prompt), tuple(answer)))
        if conv in last:
            prev, prev_answer = last[conv]
            held = len(prev) + len(prev_answer) - 1 if history_pull else len(prev)
            assert computed == len(prompt) - full_blocks(held, len(prompt)), (conv, len(prompt))
        else:
            assert computed == len(prompt)
        last[conv] = (prompt, answer)
        histories[conv] = prompt + answer
    assert_equals_hf(d.cluster.model, turns)
    return list(last.values())


def test_host_tier_alone_recomputes_the_previous_answer(model_dir, tmp_path) -> None:
    with Deployment(model_dir, HOST, tmp_path) as d:
        run_conversations(d, history_pull=False)


Holds = Callable[[str], bool]  # does the store hold the block of this hash (hex)?


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Holds]]:
    """The shared store's URL and a look inside it by block name (any key space: one model
    here): a folder, or a real redis-server on a loopback port."""
    if request.param == "file":
        root = tmp_path / "kv"
        yield f"file://{root}", lambda h: any(root.glob(f"*/{h[:2]}/{h}.kv"))
        return
    import redis

    server = LocalRedis(tmp_path)
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        yield server.url, lambda h: bool(client.keys(f"pdserve:kv:*/{h}"))
    finally:
        client.close()
        server.kill()


def stored_tokens(holds: Holds, prompt: list[int]) -> int:
    """Tokens of the prompt's leading blocks the store holds, as a prefix lookup may take
    them (never the last token)."""
    n = 0
    for block_hash in hash_token_blocks(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]:
        if not holds(block_hash.hex()):
            break
        n += BLOCK
    return n


def test_history_pull_and_a_second_prefill_node_from_the_store(model_dir, store, tmp_path) -> None:
    """1P1D on host + a shared store: turn N's prefill computes only the new message, first
    for one conversation alone (its answers never leave the decode node's pool: only the
    history write puts them in the store), then for five. Then fresh nodes on the same store
    answer each conversation's last prompt, computing only what the store lacks (their pools
    and host tiers start empty: every hit is the store's)."""
    url, holds = store
    tiers = [*HOST, "--kv-store", url]
    with Deployment(model_dir, tiers, tmp_path / "first") as d:
        run_conversations(d, history_pull=True, n_convs=1, n_turns=3, seed=8)
        last = run_conversations(d, history_pull=True)
    loaded = 0
    with Deployment(model_dir, tiers, tmp_path / "second") as d:
        for prompt, answer in last:
            in_store = stored_tokens(holds, prompt)
            got, computed = d.ask(prompt)
            assert got == answer
            assert computed == len(prompt) - in_store
            loaded += in_store
    assert loaded >= sum(len(p) for p, _ in last) // 2  # the store holds most of the history

"""Tier-aware routing on real processes (issue 40): a router (prefix-aware) and two colocated
nodes, each with a 32-block pool of 4-token blocks and a host tier. A prompt computed on one
node and then pushed out of its pool into its host tier is sent back to that node, although
the other node is the one the router prefers on a tie (the first registered): the router
learned from the heartbeats that the blocks are in that node's host tier and credits them
(its integrity view shows the host tier's blocks; its request log names the node chosen),
and the node loads them instead of computing them. The tier counters the router sums on its
/metrics equal the sum of the nodes' own /metrics."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.testbed.faults import router_metrics
from pdserve.tiny_model import make_tiny_model
from tests.e2e.test_disaggregated import assert_clean, complete

VOCAB, BLOCK = 512, 4
ENGINE = ["--block-size", str(BLOCK), "--num-blocks", "32", "--dtype", "float32"]
ENGINE += ["--heartbeat-interval", "0.2", "--kv-offload-bytes", str(64 << 20)]
ENGINE += ["--kv-load-policy", "always"]  # the test counts loads: never recompute a hit
NODES = ("both0", "both1")
SUMMED = ("hits", "misses", "loaded_bytes", "stored_bytes")
EXPECTED_S = 5.0  # how long the router counts a routed prompt as cached (`NodeInfo.routed`)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tier_routing"), vocab=VOCAB))


def node_metrics(port: int) -> dict[tuple[str, str], float]:
    """(sample name, tier label) -> value from a node's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("tier", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for(check, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:g}s: {what}")


class Routed:
    """The router's choices as its request log has them, one line per finished request."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, 0

    def new(self) -> list[dict]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        out, self.seen = [json.loads(line) for line in lines[self.seen :]], len(lines)
        return out


def test_a_prompt_in_one_nodes_host_tier_is_routed_there(model_dir: str, tmp_path: Path):
    rng = random.Random(3)
    tokens = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    health = {name: free_port() for name in NODES}
    log = tmp_path / "requests.jsonl"
    cluster = LocalCluster(
        model_dir,
        0,
        0,
        num_colocated=2,
        engine_args=ENGINE,
        router_args=["--policy", "prefix_aware", "--request-log", str(log)],
        node_args={name: ["--health-port", str(port)] for name, port in health.items()},
        log_dir=str(tmp_path),
    )
    routed = Routed(log)
    with cluster, ThreadPoolExecutor(2) as pool:
        views = lambda: cluster.integrity()  # noqa: E731 - the router's view of each node
        tie_winner, other = list(wait_for(lambda: len(views()) == 2 and views(), "2 nodes"))

        def send_pair(first: list[int], second: list[int]) -> dict[str, str]:
            """Both at once (the second finds the first in flight and goes to the other
            node); which prompt each node took, by the request log."""
            futures = [pool.submit(complete, cluster.url, p, max_tokens=8) for p in (first, second)]
            for f in futures:
                f.result(timeout=120)
            entries = wait_for(lambda: routed.new() or None, "the request log")
            while len(entries) < 2:
                entries += routed.new()
            return {e["hash_ids"][0]: e["prefill_node"] for e in entries}

        # The prompt, computed on the node a tie does not go to (tries: the order is a race).
        for _ in range(6):
            prompt = tokens(24)
            head = hash_token_blocks(prompt, BLOCK)
            if send_pair(tokens(24), prompt)[head[0].hex()[:16]] == other:
                sent = time.monotonic()
                break
        else:
            pytest.fail(f"the prompt never went to {other}")
        for _ in range(3):  # each node takes one: pushes the prompt out of its pool
            send_pair(tokens(60), tokens(60))

        def on_host() -> bool:
            view = views()[other]
            held = set(view["host_view"]) >= {h.hex() for h in head[:5]}
            return held and head[0].hex() not in view["prefix_view"]

        wait_for(on_host, f"the prompt's blocks in {other}'s host tier only")
        # The router expects a prompt it routed cached there for 5 s (`NodeInfo.routed`):
        # past that, only what the node reported counts.
        time.sleep(max(0.0, sent + EXPECTED_S + 1 - time.monotonic()))
        assert not set(views()[tie_winner]["host_view"]) & {h.hex() for h in head}
        before = node_metrics(health[other])[("pdserve:kv_tier_hits_total", "host")]
        answer = complete(cluster.url, prompt, max_tokens=8)
        (entry,) = wait_for(routed.new, "the request's log line")
        assert entry["prefill_node"] == other, "routed to where its blocks are (host tier)"
        # The node publishes its counters with its next heartbeat (`EngineNode.status`).
        host_hits = lambda: node_metrics(health[other])[("pdserve:kv_tier_hits_total", "host")]  # noqa: E731
        loading = "the node loading the prompt from its host tier"
        wait_for(lambda: host_hits() - before >= 5, loading, 10.0)
        assert len(answer["choices"][0]["token_ids"]) == 8

        def sums_agree() -> bool:
            nodes = [node_metrics(port) for port in health.values()]
            router = router_metrics(cluster.url)
            for field in SUMMED:
                total = sum(m[(f"pdserve:kv_tier_{field}_total", "host")] for m in nodes)
                if router.get(f"kv_tier_{field}_host") != total:
                    return False
            loaded = sum(m[("pdserve:kv_tier_loaded_tokens_total", "")] for m in nodes)
            return router.get("kv_tier_loaded_tokens") == loaded > 0

        wait_for(sums_agree, "the router's tier sums equal the nodes' counters")
        assert_clean(cluster)

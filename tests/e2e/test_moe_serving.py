"""Qwen3-MoE and DeepSeek-V3 (MLA) served by real processes on loopback: a router,
two prefill and two decode nodes of mixed tensor- and expert-parallel sizes, and a colocated
node, against HF transformers' greedy tokens (float32; `hf_greedy`, computed once per session
and model for the offline tests too) on tests/common/test_llm_equivalence.py's prompts (1 to
300 tokens, a shared 100-token prefix, a repeated prompt).

One deployment per architecture (process starts are most of the time), in phases:

1. one request after another: round robin pairs prefill0 (TP 2, expert parallel) with
   decode0 (TP 2, expert parallel), then prefill1 (TP 2) with decode1 (TP 1); each pair is
   seen in the nodes' prefix caches (only the pair that served a prompt caches its blocks);
2. a concurrent burst over all four (2P2D: any prefill node may fill any decode node);
3. kill -9 of decode0 while the load decodes: every answer still equals HF's (what decode0
   held fails over to decode1), every request ends in time, the survivors' pools are clean;
4. decode1 stopped: with no decode node left the router serves from the colocated node.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.local_cluster import LocalCluster
from pdserve.testbed import faults as fh
from tests.common.test_llm_equivalence import MAX_TOKENS, PROMPTS, hf_greedy
from tests.e2e.test_disaggregated import assert_reports_clean, complete

# One deployment per distinct path through the nodes: Qwen3-MoE for the MoE layer at expert and
# tensor parallel sizes, DeepSeek-V3 for MLA's single-plane cache (its own KV layout, sent and
# received). Mixtral takes Qwen3-MoE's path here (the same MoE layer, cache and transfer); its
# own weights and gate are pinned in process (tests/common/model/test_moe.py, test_moe_parallel.py:
# greedy at TP 2 equals HF, each rank's share), where a deployment costs no nine processes.
ARCHS = ("qwen3_moe", "deepseek_v3")
ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "64", "--max-model-len", "512"]
ENGINE += ["--num-blocks", "128", "--dtype", "float32", "--threads-per-rank", "1"]
ENGINE += fh.NODE_ARGS  # fast heartbeats and leases: a dead node is noticed within 1.5 s
TP2 = ["--tensor-parallel-size", "2"]
NODES = {
    "prefill0": [*TP2, "--enable-expert-parallel"],
    "prefill1": TP2,
    "decode0": [*TP2, "--enable-expert-parallel"],
}  # decode1 and both0 at TP 1
ROUTER = [*fh.ROUTER_ARGS, "--policy", "round_robin"]
ANSWER_S = 60.0  # the longest any request may take, failover included
EVERY = list(range(len(PROMPTS)))
PAIRS = [4, 5]  # 40 and 99 tokens, nothing shared: one request per pair of nodes


@pytest.fixture
def model_dirs(moe_dirs: dict[str, str], deepseek_dir: str) -> dict[str, str]:
    """The session's tiny checkpoints (tests/conftest.py)."""
    return {**moe_dirs, "deepseek_v3": deepseek_dir}


def serve_all(cluster: LocalCluster, picked: list[int], wants: list[list[int]]) -> None:
    """The prompts `picked` (indexes into PROMPTS) at once; each answer must come within
    ANSWER_S and equal HF's."""
    with ThreadPoolExecutor(max_workers=len(picked)) as pool:
        asked = [
            pool.submit(complete, cluster.url, PROMPTS[i], max_tokens=MAX_TOKENS) for i in picked
        ]
        deadline = time.monotonic() + ANSWER_S
        for i, future in zip(picked, asked, strict=True):
            answer = future.result(timeout=max(0.1, deadline - time.monotonic()))
            got = answer["choices"][0]["token_ids"]
            assert got == wants[i], f"prompt {i} ({len(PROMPTS[i])} tokens): {got} != HF"


def caching(cluster: LocalCluster) -> set[str]:
    """The nodes whose prefix cache holds blocks: those that served a prompt."""
    return {n for n, r in cluster.integrity().items() if r["report"]["cached_blocks"]}


def prove_pairs(cluster: LocalCluster, wants: list[list[int]]) -> None:
    """Two requests in turn: round robin takes decode0 and prefill0 first, then the next of
    each; the caches show which pair served each request."""
    assert caching(cluster) == set()
    serve_all(cluster, PAIRS[:1], wants)
    assert caching(cluster) == {"prefill0", "decode0"}  # EP 2 on both sides
    serve_all(cluster, PAIRS[1:], wants)
    assert caching(cluster) == {"prefill0", "decode0", "prefill1", "decode1"}  # TP 2 -> TP 1


def streamed_tokens(url: str) -> float:
    """Tokens the router has had from nodes so far (its Prometheus counter)."""
    text = httpx.get(url + "/metrics", timeout=10, verify=False).text  # plain HTTP
    found = re.search(r"^pdserve_router_generation_tokens_total (\S+)$", text, re.M)
    assert found is not None, "the router exports no generation_tokens counter"
    return float(found.group(1))


def kill_mid_decode(
    cluster: LocalCluster, since: float, requests: int, done: threading.Event
) -> None:
    """kill -9 decode0 once the load decodes (more tokens since `since` than the requests'
    first tokens, which prefill nodes sample) and decode0 holds requests."""
    while not (
        streamed_tokens(cluster.url) - since > requests
        and cluster.integrity()["decode0"]["report"]["live_requests"]
    ):
        assert not done.wait(0.01), "decode0 held no request while the load decoded"
    cluster.procs["decode0"].kill()


def proc_stat(pid: int) -> tuple[str, int]:
    """A process's state letter and parent pid (/proc); ("X", 0), dead, once it is gone."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return "X", 0
    return state, int(ppid)


def worker_ranks(pid: int) -> list[int]:
    """The child processes of node process `pid`: its TP group's other ranks."""
    found = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [c for c in found if proc_stat(c)[1] == pid]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Those of `pids` still running (neither gone nor a zombie) after up to timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in pids if proc_stat(p)[0] not in "ZX"]  # a zombie has exited
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def kill_decode0_under_load(cluster: LocalCluster, wants: list[list[int]]) -> None:
    """kill -9 decode0 mid-load: its ranks all exit, and every request still gets HF's
    answer (what decode0 held resumes on decode1) in time."""
    workers = worker_ranks(cluster.procs["decode0"].pid)
    assert len(workers) == 1, f"decode0 should be a TP group of two ranks: {workers}"
    since, done = streamed_tokens(cluster.url), threading.Event()
    with ThreadPoolExecutor(max_workers=1) as killer:
        killed = killer.submit(kill_mid_decode, cluster, since, len(PROMPTS), done)
        try:
            serve_all(cluster, EVERY, wants)
        finally:
            done.set()
        killed.result(timeout=ANSWER_S)
    assert fh.router_failovers(cluster.url) > 0, "decode0 held requests: they must have moved"
    cluster.procs["decode0"].wait(timeout=10)
    assert wait_gone(workers, timeout=30) == [], "decode0's worker rank outlived it"


def stop_decode1(cluster: LocalCluster) -> None:
    """SIGTERM decode1 (idle: it drains at once) and wait until the router dropped it."""
    proc = cluster.procs["decode1"]
    proc.terminate()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while "decode1" in cluster.integrity():
        assert time.monotonic() < deadline, "the router still lists decode1"
        time.sleep(0.1)


def assert_survivors_clean(cluster: LocalCluster, survivors: set[str]) -> None:
    reports = fh.wait_clean(cluster)
    assert set(reports) == survivors
    assert_reports_clean(reports, len(survivors))


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_model_through_pd_processes(arch: str, model_dirs: dict[str, str], tmp_path) -> None:
    model = model_dirs[arch]
    cluster = LocalCluster(
        model,
        2,
        2,
        num_colocated=1,
        engine_args=ENGINE,
        router_args=ROUTER,
        node_args=NODES,
        log_dir=str(tmp_path),
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: nine processes, two cores
        for name in cluster.children():
            cluster.spawn(name)
    try:
        wants = hf_greedy(model)[0]  # while the nodes start (when no other module asked yet)
        cluster.wait_ready(timeout=120)
        prove_pairs(cluster, wants)
        serve_all(cluster, [i for i in EVERY if i not in PAIRS], wants)
        assert_survivors_clean(cluster, {"prefill0", "prefill1", "decode0", "decode1", "both0"})
        kill_decode0_under_load(cluster, wants)
        assert_survivors_clean(cluster, {"prefill0", "prefill1", "decode1", "both0"})
        assert "both0" not in caching(cluster)  # colocated only when no decode node is left
        stop_decode1(cluster)
        serve_all(cluster, [3, 7, 8, 9], wants)  # 300 tokens: five chunks
        assert "both0" in caching(cluster), "the colocated node served nothing"
        assert_survivors_clean(cluster, {"prefill0", "prefill1", "both0"})
    finally:
        cluster.stop()


def test_node_args_reach_only_their_node() -> None:
    cluster = LocalCluster("m", 2, 1, num_colocated=1, node_args={"prefill1": ["-tp", "2"]})
    children = cluster.children()
    assert children["prefill1"][-2:] == ["-tp", "2"]
    assert all("-tp" not in args for name, args in children.items() if name != "prefill1")
    with pytest.raises(ValueError, match="decode3"):
        LocalCluster("m", node_args={"decode3": []}).children()

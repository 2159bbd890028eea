"""Load plus one injected fault against a real local cluster, and what became of each request.

Shared by tests/e2e/test_faults.py (which asserts) and scripts/reliability_report.py (which
writes docs/reliability.md). Every request is greedy, so a complete answer can be checked
token for token against the in-process engine; the outcome of each is one of

  ok            complete, and equal to the reference
  error         an explicit failure: an HTTP error status or finish_reason "error"
  disconnected  the client went away on purpose mid-stream
  wrong         a 200 whose tokens differ from the reference: must never happen
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster

MAX_TOKENS = 12
NUM_REQUESTS = 100
ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "128", "--max-model-len", "1100"]
ENGINE += ["--dtype", "float32"]  # as the offline reference
# Fast failure detection for tests: nodes heartbeat every 0.2 s, the router gives up on one
# after 1.5 s, and nodes free requests the router stopped renewing after 6 s. A decode node
# holds all 100 requests, so the survivor of two can take over every stream.
NODE_ARGS = ["--heartbeat-interval", "0.2", "--lease-timeout", "6", "--max-num-seqs", "128"]
NODE_ARGS += ["--drain-timeout", "15"]  # what a draining node still holds then fails over
# Remote prefill always: the faults are on the KV path.
ROUTER_ARGS = [
    "--heartbeat-timeout",
    "1.5",
    "--lease-interval",
    "0.3",
    "--prefill-placement",
    "remote",
]


def make_prompts(vocab: int, n: int = NUM_REQUESTS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 300))] for _ in range(n)]


def reference(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [
        o.token_ids
        for o in LLM(model_dir, block_size=16, dtype="float32").generate(prompts, params)
    ]


@dataclass
class Outcome:
    index: int
    status: str
    start: float
    end: float
    detail: str = ""


@dataclass
class Run:
    """One scenario's result: outcomes, when the fault hit, and what the router counted."""

    scenario: str
    fault_at: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    failovers: int = 0

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    def recovery_s(self) -> float:
        """From the fault to the end of the last request that was in flight when it hit."""
        hit = [o.end for o in self.outcomes if o.start <= self.fault_at <= o.end]
        return max(hit) - self.fault_at if hit else 0.0

    def summary(self) -> dict:
        return {
            "scenario": self.scenario,
            "requests": len(self.outcomes),
            "ok": self.count("ok"),
            "error": self.count("error"),
            "disconnected": self.count("disconnected"),
            "wrong": self.count("wrong"),
            "failovers": self.failovers,
            "recovery_s": round(self.recovery_s(), 2),
            "errors": sorted({o.detail for o in self.outcomes if o.status == "error"})[:5],
        }


def one_request(
    client: httpx.Client, url: str, index: int, prompt: list[int], want: list[int],
    disconnect: bool,
) -> Outcome:  # fmt: skip
    """Stream one completion; check its token ids against `want` (or drop it after two
    chunks: closing the unread response closes its connection)."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.monotonic()
    got, finish, chunks = [], None, 0
    try:
        with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                resp.read()
                why = f"HTTP {resp.status_code}"
                if resp.status_code != 503:  # 503s differ only in load figures
                    why += f": {resp.text[:60]}"
                return Outcome(index, "error", start, time.monotonic(), why)
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    why = str(chunk["error"].get("message", ""))[:80]
                    return Outcome(index, "error", start, time.monotonic(), why)
                for choice in chunk.get("choices", []):
                    got += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
                chunks += 1
                if disconnect and chunks >= 2:
                    return Outcome(index, "disconnected", start, time.monotonic())
    except httpx.HTTPError as exc:
        return Outcome(index, "error", start, time.monotonic(), type(exc).__name__)
    end = time.monotonic()
    if finish == "error":
        return Outcome(index, "error", start, end, "finish_reason error")
    if finish == "length" and got == want:
        return Outcome(index, "ok", start, end)
    return Outcome(index, "wrong", start, end, f"finish {finish!r}, tokens {got} != {want}")


def run_scenario(
    name: str,
    cluster: LocalCluster,
    prompts: list[list[int]],
    wants: list[list[int]],
    fault: Callable[[LocalCluster], None] | None = None,
    fault_after_s: float = 1.0,
    disconnect_fraction: float = 0.0,
    when: Callable[[LocalCluster], bool] | None = None,
) -> Run:
    """All requests at once; `fault(cluster)` runs `fault_after_s` into the load, or with
    `when`, at the first moment after that `when(cluster)` holds (a fault meant to hit work
    in flight waits for it, however fast the nodes are); `run.fault_at` stays 0 when the load
    ended first. The run's failovers are the router's count during it (a cluster may serve
    several scenarios)."""
    run = Run(name)
    failovers_before = router_failovers(cluster.url)
    rng = random.Random(1)
    drops = {i for i in range(len(prompts)) if rng.random() < disconnect_fraction}
    finished = threading.Event()

    def injector() -> None:
        if finished.wait(fault_after_s) or fault is None:
            return
        while when is not None and not when(cluster):
            if finished.wait(0.02):
                return
        run.fault_at = time.monotonic()
        fault(cluster)

    thread = threading.Thread(target=injector)
    # One client for every request: each new one loads the CA bundle (~25 ms of CPU, under
    # the GIL), which for 100 requests at once held the injector back ~1.5 s.
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(len(prompts)) as pool:
        thread.start()  # before the requests: sending them all takes a while (the GIL)
        futures = [
            pool.submit(one_request, client, cluster.url, i, p, w, i in drops)
            for i, (p, w) in enumerate(zip(prompts, wants, strict=True))
        ]
        run.outcomes = [f.result() for f in futures]
    finished.set()
    thread.join()
    run.failovers = router_failovers(cluster.url) - failovers_before
    return run


def holding(node: str, at_least: int = 1) -> Callable[[LocalCluster], bool]:
    """`when` for run_scenario: the router has at least that many requests on node that have
    not ended (its integrity report's `in_flight`: requests it still waits on the node for; a
    node's own `live_requests` also names finished ones it has not let go of yet). A fault
    that must catch unfinished work asks for a few: the count is some ms old when it hits."""

    def held(cluster: LocalCluster) -> bool:
        return (cluster.integrity().get(node) or {}).get("in_flight", 0) >= at_least

    return held


def router_metrics(url: str) -> dict[str, float]:
    """The backend gauges of the router at `url` (its /metrics), without the prefix:
    `failovers`, `prefix_blocks_prefill`, ..."""
    resp = httpx.get(url + "/metrics", timeout=10, verify=False)  # plain HTTP: no CA bundle
    found = re.findall(r"^pdserve_backend_(\w+) ([0-9.e+-]+)$", resp.text, re.M)
    return {k: float(v) for k, v in found}


def router_failovers(url: str) -> int:
    """The router at `url`'s count of requests it moved to another node."""
    return int(router_metrics(url).get("failovers", 0))


def wait_clean(cluster: LocalCluster, timeout: float = 30.0) -> dict:
    """Until every node that answers reports no live request and every block free or cached,
    and the router waits on none; returns the last reports (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        reports = cluster.integrity()
        clean = all(
            r["report"] is not None
            and r["report"]["ok"]
            and not r["report"]["live_requests"]
            and r["report"]["free_blocks"] == r["report"]["num_blocks"]
            and not r.get("in_flight")  # a router from before the count has none
            for r in reports.values()
        )
        if clean or time.monotonic() > deadline:
            return reports
        time.sleep(0.5)


def wait_members(cluster: LocalCluster, names: set[str], timeout: float = 30.0) -> set[str]:
    """Until the router counts exactly `names` as its live nodes; returns the last set (the
    caller asserts on it). A node whose heartbeats a loaded machine delayed past the router's
    timeout is dropped and comes back at its next one."""
    deadline = time.monotonic() + timeout
    while True:
        members = set(cluster.integrity())
        if members == names or time.monotonic() > deadline:
            return members
        time.sleep(0.5)


def cluster_for(
    model_dir: str,
    router_extra: tuple[str, ...] = (),
    node_extra: tuple[str, ...] = (),
    **kwargs,
) -> LocalCluster:
    return LocalCluster(
        model_dir,
        kwargs.pop("num_prefill", 2),
        kwargs.pop("num_decode", 2),
        engine_args=[*ENGINE, *NODE_ARGS, *node_extra],
        router_args=[*ROUTER_ARGS, *router_extra],
        **kwargs,
    )


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def save(runs: list[Run], path: str) -> None:
    with open(path, "w") as f:
        json.dump([{**r.summary(), "outcomes": [asdict(o) for o in r.outcomes]} for r in runs], f)

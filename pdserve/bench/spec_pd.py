"""`pdserve bench spec`'s 1P1D rows: each system as a real deployment (router, prefill node and
decode node processes on loopback, zmq, the speculative config on both nodes), the same
prompts, greedy, `batch` requests at a time over HTTP. One deployment per measurement (system,
workload, batch size), as the colocated rows start each measurement with a fresh drafter:
suffix decoding's tree would otherwise hold the answers of the run before. The decode node's
`spec_decode_*` counters, read after each request at batch 1, give the accepted drafts per
request to compare with the colocated run's."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.multiturn import scrape
from pdserve.bench.systems import environ, threads_env
from pdserve.local_cluster import LocalCluster, free_port

DRAFTS, ACCEPTED = "spec_decode_num_drafts", "spec_decode_num_accepted_tokens"
COUNTERS = (DRAFTS, "spec_decode_num_draft_tokens", ACCEPTED)
HEARTBEAT_WAIT_S = 15.0  # a node publishes its counters with its next heartbeat
START_TIMEOUT_S = 600.0  # three processes loading torch and the model on a shared machine
STOP_TIMEOUT_S = 30.0  # for the nodes to drain and exit


@contextmanager
def deployment(
    model: Path, args: argparse.Namespace, config: str | None, name: str
) -> Iterator[tuple[str, str]]:
    """1P1D on `model` with `config` (--speculative-config JSON, None: none) on both nodes,
    eager (no compile children beside the run); yields the router's URL and the decode node's
    health URL (its counters)."""
    health = free_port()
    engine = ["--dtype", args.dtype, "--max-num-seqs", str(max(args.batch_sizes))]
    engine += ["--enforce-eager", *(["--speculative-config", config] if config else [])]
    log_dir = Path(args.cache_dir) / "spec-pd-logs" / name
    cluster = LocalCluster(str(model), 1, 1, kv_connector="zmq", engine_args=engine,
                           decode_args=["--health-port", str(health)],
                           log_dir=str(log_dir))  # fmt: skip
    with environ(threads_env(args.threads)):
        try:
            cluster.start(timeout=START_TIMEOUT_S)
            yield cluster.url, f"http://127.0.0.1:{health}"
        finally:
            try:
                cluster.stop(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:  # killed, still exiting: not the run's fault
                print(f"!! {name}: {exc}", file=sys.stderr, flush=True)


def counters(health: str) -> dict[str, float]:
    """The decode node's speculative counters now (0 before its first verify step)."""
    resp = httpx.get(f"{health}/metrics", timeout=10)
    resp.raise_for_status()
    node = scrape(resp.text, "pdserve_node_")
    return {name: node.get(name, 0.0) for name in COUNTERS}


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    resp = client.post(f"{url}/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def settled(health: str, drafts: float) -> dict[str, float]:
    """The counters once they show at least `drafts` verify steps, or after HEARTBEAT_WAIT_S
    (a run that drafted less than expected is what the comparison reports)."""
    deadline = time.monotonic() + HEARTBEAT_WAIT_S
    now = counters(health)
    while now[DRAFTS] < drafts and time.monotonic() < deadline:
        time.sleep(0.2)
        now = counters(health)
    return now


def timed_pd_run(url: str, health: str, prompts: list[list[int]], batch: int,
                 max_tokens: int, expected: Sequence[float]) -> dict[str, Any]:  # fmt: skip
    """The prompts `batch` at a time (each group's requests at once): wall time, tokens, the
    decode node's counters; at batch 1 the running total of accepted drafts after each
    request, waiting for the heartbeat that carries `expected[i]` drafts (colocated's)."""
    tokens: list[list[int]] = []
    after: list[float] = []
    start = time.perf_counter()
    with httpx.Client(verify=False) as client, ThreadPoolExecutor(batch) as pool:
        for at in range(0, len(prompts), batch):
            group = prompts[at : at + batch]
            tokens += pool.map(lambda p: complete(client, url, p, max_tokens), group)
            if batch == 1 and expected:
                after.append(settled(health, expected[len(after)])[ACCEPTED])
    wall = time.perf_counter() - start
    final = settled(health, expected[-1] if expected else 0.0)
    n = sum(map(len, tokens))
    return {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall, "tokens": tokens,
            "accepted_after": after, **final}  # fmt: skip


def measure_pd(args: argparse.Namespace, model: Path, prompts: dict[str, list[list[int]]],
               configs: dict[str, str | None], colocated: dict) -> dict[tuple, dict]:  # fmt: skip
    """Every (workload, batch, system) of `configs` through its own 1P1D deployment;
    `colocated[(workload, batch, system)]` is the colocated run whose drafts it waits for."""
    runs: dict[tuple[str, int, str], dict] = {}
    for workload, ps in prompts.items():
        for batch in args.batch_sizes:
            ps_b = ps[: args.batch1_prompts] if batch == 1 else ps
            for system, config in configs.items():
                expected = colocated[workload, batch, system][0].get("drafts_after", [])
                name = f"{workload}-b{batch}-{system.replace(' ', '_')}"
                with deployment(model, args, config, name) as (url, health):
                    run = timed_pd_run(url, health, ps_b, batch, args.max_tokens, expected)
                runs[workload, batch, system] = run
                print(f"1P1D {workload} batch {batch} {system}: "
                      f"{run['tokens_per_s']:.2f} tok/s", flush=True)  # fmt: skip
    return runs

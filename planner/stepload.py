"""A load that steps up and down against `pdserve serve --planner`, for the end-to-end test and
the real run (`scripts/planner_run.py`): closed-loop clients, as many at once as the current
phase says, each sending greedy completions of token-id prompts; every answer kept with its
TTFT (the router's, `return_metrics`) so it can be checked against the offline engine; and the
nodes of each role sampled from the router's /internal/load meanwhile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.local_cluster import free_port


@dataclass(frozen=True, slots=True)
class Phase:
    """`clients` requests in flight at any time, for `seconds`."""

    seconds: float
    clients: int


@dataclass(frozen=True, slots=True)
class Answer:
    """One request: when it was sent (s since the load began), which prompt, what came back."""

    sent: float
    prompt: int
    token_ids: tuple[int, ...] | None  # None: failed
    ttft: float | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class NodeSample:
    """The nodes the router knew at `at` (s since the load began), by role, draining apart."""

    at: float
    prefill: int
    decode: int
    draining: int


class Serve:
    """`pdserve serve MODEL --planner ...` as a child process (its own process group) on free
    ports, its output in `log`; `stop()` sends SIGTERM (it drains) and waits."""

    def __init__(self, model: str, flags: Sequence[str], log: Path, timeout: float = 30.0) -> None:
        self.port = free_port()
        exe = shutil.which("pdserve")
        cmd = [exe] if exe else [sys.executable, "-m", "pdserve"]
        cmd += ["serve", model, "--port", str(self.port), "--control-port", str(free_port())]
        cmd += ["--served-model-name", "m", *flags]
        self.log = log.open("wb")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, process_group=0
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited ({self.proc.returncode})")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"pdserve serve not ready after {timeout:.0f} s")

    def nodes(self) -> NodeSample | None:
        try:
            load = self.http.get("/internal/load").json()
        except (httpx.HTTPError, ValueError):
            return None
        live = [n for n in load.values() if not n["draining"]]
        count = lambda role: sum(n["role"] == role for n in live)  # noqa: E731
        return NodeSample(0.0, count("prefill"), count("decode"), len(load) - len(live))

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[tuple[int, ...], float]:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "return_metrics": True}  # fmt: skip
        r = self.http.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        choice = r.json()["choices"][0]
        return tuple(choice["token_ids"]), choice["metrics"]["time_to_first_token"]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)  # its own group: the children too
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def run_load(
    serve: Serve, phases: Sequence[Phase], prompts: Sequence[list[int]], max_tokens: int
) -> tuple[list[Answer], list[NodeSample]]:
    """The phases one after another; every answer, and the nodes sampled every second."""
    answers: list[Answer] = []
    samples: list[NodeSample] = []
    start = time.monotonic()
    ends = [start + sum(p.seconds for p in phases[: i + 1]) for i in range(len(phases))]
    lock = threading.Lock()

    def clients_now(now: float) -> int | None:
        i = next((i for i, end in enumerate(ends) if now < end), None)
        return None if i is None else phases[i].clients

    def client(k: int) -> None:
        sent = 0
        while (n := clients_now(time.monotonic())) is not None:
            if k >= n:
                time.sleep(0.05)
                continue
            i = (k * 7919 + sent) % len(prompts)
            sent += 1
            at = time.monotonic() - start
            try:
                ids, ttft = serve.complete(prompts[i], max_tokens)
                answer = Answer(at, i, ids, ttft)
            except (httpx.HTTPError, RuntimeError, KeyError) as exc:
                answer = Answer(at, i, None, None, str(exc))
            with lock:
                answers.append(answer)

    workers = [threading.Thread(target=client, args=(k,), daemon=True)
               for k in range(max(p.clients for p in phases))]  # fmt: skip
    for w in workers:
        w.start()
    while clients_now(time.monotonic()) is not None:
        sample = serve.nodes()
        if sample is not None:
            at = time.monotonic() - start
            samples.append(NodeSample(at, sample.prefill, sample.decode, sample.draining))
        time.sleep(1.0)
    for w in workers:
        w.join(timeout=serve.http.timeout.read or 60.0)
    return sorted(answers, key=lambda a: a.sent), samples

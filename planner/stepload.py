"""A load that steps up and down against `pdserve serve --planner`, for the end-to-end test and
the real run (`scripts/planner_run.py`): requests sent at the current phase's rate (open loop:
a slow deployment does not slow the arrivals, as it would with a fixed number of clients),
each a greedy completion of a token-id prompt; every answer kept with its
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import free_port


def reference(model: str, prompts: Sequence[list[int]], max_tokens: int) -> list[tuple[int, ...]]:
    """The offline engine's greedy answers (float32), what every served answer must equal. On
    one thread: beside a running deployment on a loaded machine, two threads waiting on each
    other at every op took 38 s for eight 512-token prompts, one thread 7 s."""
    threads = torch.get_num_threads()
    try:
        llm = LLM(model, dtype="float32", enforce_eager=True, threads_per_rank=1)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [tuple(o.token_ids) for o in llm.generate(list(prompts), params)]
    finally:
        torch.set_num_threads(threads)  # this process's, for whatever runs next in it


@dataclass(frozen=True, slots=True)
class Phase:
    """`rate` requests per second, evenly spaced, for `seconds` (0: none, idle)."""

    seconds: float
    rate: float


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
        answer = r.json()
        return tuple(answer["choices"][0]["token_ids"]), answer["metrics"][0]["time_to_first_token"]

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
    """The phases one after another; every answer (all waited for), and the nodes sampled
    every second until the last answer."""
    start = time.monotonic()
    answers: list[Answer] = []

    def send(i: int, at: float) -> None:
        try:
            ids, ttft = serve.complete(prompts[i], max_tokens)
            answers.append(Answer(at, i, ids, ttft))
        except (httpx.HTTPError, RuntimeError, KeyError, IndexError) as exc:
            answers.append(Answer(at, i, None, None, f"{type(exc).__name__}: {exc}"))

    sender = threading.Thread(target=_send_all, args=(phases, len(prompts), send, start))
    sender.start()
    samples: list[NodeSample] = []
    while sender.is_alive():
        sample = serve.nodes()
        if sample is not None:
            at = time.monotonic() - start
            samples.append(NodeSample(at, sample.prefill, sample.decode, sample.draining))
        sender.join(1.0)
    return sorted(answers, key=lambda a: a.sent), samples


def _send_all(
    phases: Sequence[Phase], count: int, send: Callable[[int, float], None], start: float
) -> None:
    """Each request in its own thread at its time; returns when every one has answered."""
    threads, at, n = [], 0.0, 0
    for phase in phases:
        end = at + phase.seconds
        while at < end:
            time.sleep(max(0.0, start + (at if phase.rate > 0 else end) - time.monotonic()))
            if phase.rate <= 0:  # an idle phase
                break
            t = threading.Thread(target=send, args=(n % count, at), daemon=True)
            t.start()
            threads.append(t)
            n += 1
            at += 1.0 / phase.rate
        at = end
    for t in threads:
        t.join()

"""`pdserve serve` as a user runs it (the console script, real processes and sockets): a 2P2D
deployment, every node at TP 2, that survives `kill -9` of a prefill node, of one rank of a
prefill node, of one rank of a decode node and of the router under load, with every answer
equal to the offline engine's, and that SIGTERM stops whole."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.local_cluster import free_port

MAX_TOKENS = 12
# Prompts of 16+ tokens, so a prefill node that served one holds a cached block afterwards.
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog, again" for i in range(24)]
LATER = [f"Later {i}: the quick brown fox jumps over the lazy dog, once more" for i in range(6)]
BACK_IN_ROTATION_S = 30.0


class Deployment:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.port, self.control, self.metrics_port = free_port(), free_port(), free_port()
        exe = shutil.which("pdserve")
        cmd = [exe] if exe else [sys.executable, "-m", "pdserve"]
        cmd += [
            "serve",
            str(model),
            "--num-prefill",
            "2",
            "--num-decode",
            "2",
            "--port",
            str(self.port),
            "--control-port",
            str(self.control),
            "--supervisor-metrics-port",
            str(self.metrics_port),
            "--restart-backoff",
            "0.5",
            "--log-dir",
            str(log_dir),
            "--served-model-name",
            "m",
            "--num-blocks",  # an engine flag every node gets (and less memory than the default)
            "256",
            "--dtype",  # the offline reference runs float32
            "float32",
            "--policy",
            "round_robin",
            "--prefill-tp",  # each node: rank 0 and one worker process
            "2",
            "--decode-tp",
            "2",
            "--threads-per-rank",
            "1",
            "--router-flags",
            "--heartbeat-timeout 2",
        ]
        self.log_dir = log_dir
        self.log = (log_dir / "serve.out").open("wb")
        # One compute thread per child: four processes share two cores in CI, and a restarted
        # node must not starve behind the survivors' thread pools.
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        # No kept-alive connections: the tests wait longer than uvicorn keeps an idle one, and
        # a request sent on one it is closing that moment is reset (a client-side race).
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            timeout=120,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def pids(self, role_flag: str) -> list[int]:
        """Pids of this deployment's children whose command line holds role_flag."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            line = b" ".join(argv).decode(errors="replace")
            mine = f"127.0.0.1:{self.control}" in line or f"--control-port {self.control}" in line
            if mine and "-m pdserve" in line and role_flag in line:
                out.append(int(entry.name))
        return out

    def output(self) -> str:
        """What `pdserve serve` itself logged so far."""
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def metric(self, name: str, child: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        m = re.search(rf'^{name}{{child="{child}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else -1.0

    def router_metric(self, name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", self.http.get("/metrics").text, re.M)
        return float(m.group(1)) if m else -1.0

    def restarts(self, child: str) -> float:
        return self.metric("pdserve_supervisor_child_restarts_total", child)

    def report(self, node: str) -> dict | None:
        return (self.nodes().get(node) or {}).get("report")

    def nodes(self) -> dict:
        try:
            r = self.http.get("/internal/integrity", timeout=10)
        except httpx.HTTPError:
            return {}
        return r.json() if r.status_code == 200 else {}

    def wait(self, what: str, ok, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            assert self.proc.poll() is None, "pdserve serve exited"
            if ok():
                return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def ready(self) -> bool:
        return set(self.nodes()) == {"prefill0", "prefill1", "decode0", "decode1"}

    def complete(self, prompt: list[int]) -> list[int]:
        body = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = self.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, list[int]]:
    """Prompt text -> (prompt token ids, the offline engine's greedy output)."""
    llm = LLM(str(model_dir), dtype="float32")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS + LATER]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return {
        text: (ids, list(o.token_ids))
        for text, ids, o in zip(PROMPTS + LATER, prompts, outs, strict=True)
    }


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory) -> Iterator[Deployment]:
    d = Deployment(model_dir, tmp_path_factory.mktemp("serve"))
    try:
        d.wait("the deployment to be ready", d.ready, 180)
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(30)
        for pid in d.pids(""):  # never leave children behind, whatever failed
            os.kill(pid, signal.SIGKILL)
        d.log.close()


def _under_load(d: Deployment, expected: dict, victim: int) -> None:
    """24 concurrent greedy requests: half in flight when the victim gets kill -9, half sent
    right after, while the router still counts it alive (so both its in-flight work and new
    requests routed to the dead node must fail over)."""
    half = len(PROMPTS) // 2
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {p: pool.submit(d.complete, expected[p][0]) for p in PROMPTS[:half]}
        time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        futures |= {p: pool.submit(d.complete, expected[p][0]) for p in PROMPTS[half:]}
        answers = {p: f.result(timeout=180) for p, f in futures.items()}  # none hangs
    wrong = [p for p in PROMPTS if answers[p] != expected[p][1]]
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {answers[wrong[0]]!r}"


def test_kill_9_of_a_prefill_node_under_load(deployment: Deployment, expected) -> None:
    d = deployment
    (victim,) = d.pids("--node-id prefill0")

    def back() -> bool:  # restarted (a new process) and answering the router's integrity check
        return d.restarts("prefill0") == 1 and bool(d.report("prefill0"))

    with ThreadPoolExecutor(1) as watcher:  # the clock runs from just before the kill
        rotation = watcher.submit(d.wait, "prefill0 back in rotation", back, BACK_IN_ROTATION_S)
        _under_load(d, expected, victim)
        rotation.result()
    assert d.pids("--node-id prefill0") not in ([], [victim])
    assert d.router_metric("pdserve_backend_failovers") > 0  # the kill hit routed requests
    assert "prefill0 exited (killed by SIGKILL); restarting in" in d.output()
    # And it serves again: round robin sends it half of these, whose blocks it then caches.
    before = d.report("prefill0")["cached_blocks"]
    assert [d.complete(expected[p][0]) for p in LATER] == [expected[p][1] for p in LATER]
    report = d.report("prefill0")
    assert report["ok"] and report["cached_blocks"] > before, (before, report)


def _workers(pid: int) -> list[int]:
    """The tensor-parallel worker ranks a node process started."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _ppid(int(p.name)) == pid and "tensor_parallel" in _cmdline(p)
    ]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize("name", ["prefill1", "decode1"])
def test_kill_9_of_one_rank_of_a_node_under_load(deployment: Deployment, expected, name) -> None:
    """The node's group stops as one (its loop sees the rank gone), the router fails its
    requests over (a decode node's streams resume on the other one), and `pdserve serve`
    starts the node, both ranks, again."""
    d = deployment
    d.wait("every node to be ready", d.ready, 60)
    (node,) = d.pids(f"--node-id {name}")
    (victim,) = _workers(node)
    restarts = d.restarts(name)
    failovers = d.router_metric("pdserve_backend_failovers")

    def back() -> bool:
        return d.restarts(name) == restarts + 1 and bool(d.report(name))

    with ThreadPoolExecutor(1) as watcher:
        rotation = watcher.submit(d.wait, f"{name} back in rotation", back, BACK_IN_ROTATION_S)
        _under_load(d, expected, victim)
        rotation.result()
    assert "tensor-parallel group broken: rank 1 exited with -9" in (
        d.log_dir / f"{name}.log"
    ).read_text(errors="replace")
    assert d.router_metric("pdserve_backend_failovers") > failovers  # it held routed requests
    (again,) = d.pids(f"--node-id {name}")
    assert again != node and len(_workers(again)) == 1
    assert [d.complete(expected[p][0]) for p in LATER] == [expected[p][1] for p in LATER]


def test_kill_9_of_the_router(deployment: Deployment, expected) -> None:
    d = deployment
    (router,) = d.pids("pdserve router")
    os.kill(router, signal.SIGKILL)
    d.wait("the router to restart", lambda: d.restarts("router") == 1, 30)
    assert "router exited (killed by SIGKILL); restarting in" in d.output()
    d.wait("every node to register with the new router", d.ready, 60)
    assert d.pids("pdserve router") not in ([], [router])
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(d.complete, [expected[p][0] for p in PROMPTS[:8]]))
    assert answers == [expected[p][1] for p in PROMPTS[:8]]
    for node, info in d.nodes().items():
        assert info["report"]["ok"] and not info["report"]["live_requests"], node
        assert info["registrations"] == 1, (node, info)  # one, however often it was asked
        # serve's --num-blocks 256 reached it (less the null block; the default is thousands)
        assert 0 < info["report"]["num_blocks"] <= 256, (node, info)


def test_sigterm_stops_every_child(deployment: Deployment) -> None:
    d = deployment
    # serve's own children only: a node may fork a short-lived helper that still carries the
    # node's command line until it execs (seen once under load).
    children = [pid for pid in d.pids("") if _ppid(pid) == d.proc.pid]
    assert len(children) == 5, children  # router, two prefill nodes, two decode nodes
    workers = [w for pid in children for w in _workers(pid)]
    assert len(workers) == 4, workers  # one more rank per node
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(90) == 0
    alive = [pid for pid in children + workers if Path(f"/proc/{pid}").exists()]
    assert not alive, f"children left running: {alive}"
    # Each drained and ended by itself (uvicorn re-raises the SIGTERM it handled), none killed.
    stopped = dict(re.findall(r"INFO pdserve.serve: (\S+) stopped \((.*)\)$", d.output(), re.M))
    assert set(stopped) == {"router", "prefill0", "prefill1", "decode0", "decode1"}, stopped
    assert set(stopped.values()) <= {"exit code 0", "on SIGTERM"}, stopped


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state

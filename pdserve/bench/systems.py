"""The systems the HTTP benchmarks compare, each started, waited for (with a timeout) and
stopped on exit: pdserve nodes and a router, `transformers serve`, routers over fake nodes."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.report import environ
from pdserve.local_cluster import LocalCluster, free_port
from pdserve.testbed import fake_nodes

HOST = "127.0.0.1"


def threads_env(threads: int) -> dict[str, str | None]:
    """Torch threads of every server started inside (0: torch's own choice)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}


def http_ok(url: str, contains: str = "") -> bool:
    """One look: `url` answers 200 (and its body holds `contains`)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200 and contains in resp.read().decode(errors="replace")
    except OSError:
        return False


def wait_until(
    ready: Callable[[], bool], procs: Mapping[str, subprocess.Popen], timeout: float, what: str
) -> None:
    """Poll `ready` until it holds; RuntimeError when one of procs exits first or timeout
    passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"{what}: exited during start: {dead}")
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:g}s")


def start_group(
    cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen:
    """`cmd` in a process group of its own, output into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        return subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def stop_group(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after timeout."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@contextmanager
def process_group(
    cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`start_group`, stopped with `stop_group` on exit."""
    proc = start_group(cmd, log, env)
    try:
        yield proc
    finally:
        stop_group(proc)


@contextmanager
def pdserve_cluster(
    model: str | Path,
    shape: tuple[int, int, int],
    log_dir: Path,
    *,
    threads: int = 1,
    engine_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
) -> Iterator[LocalCluster]:
    """(prefill, decode, colocated) nodes and a router over zmq, every server process at
    `threads` torch threads; yields the ready cluster."""
    prefill, decode, colocated = shape
    cluster = LocalCluster(
        str(model),
        prefill,
        decode,
        num_colocated=colocated,
        kv_connector="zmq",
        engine_args=list(engine_args),
        router_args=list(router_args),
        decode_args=list(decode_args),
        log_dir=str(log_dir),
    )
    with environ(threads_env(threads)), cluster:
        yield cluster


@contextmanager
def transformers_serve(
    model: Path, batch_tokens: int, log_dir: Path, threads: int = 1, timeout: float = 600.0
) -> Iterator[str]:
    """`transformers serve --continuous-batching` on a free port, offline; yields its URL."""
    port = free_port()
    hub_cache = log_dir / "hf-hub-cache"  # empty: /v1/models lists nothing instead of a 500
    hub_cache.mkdir(parents=True, exist_ok=True)
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    env = {**os.environ, **offline, **{k: v for k, v in threads_env(threads).items() if v}}
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve"]
    cmd += ["--continuous-batching", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--cb-max-batch-tokens", str(batch_tokens), "--host", HOST, "--port", str(port)]
    url = f"http://{HOST}:{port}"
    with process_group([*cmd, str(model)], log_dir / "transformers-serve.log", env) as proc:
        wait_until(lambda: http_ok(f"{url}/health"), {"transformers serve": proc}, timeout, url)
        yield url


@dataclass
class RoutersOverFakes:
    """Routers (`python -m pdserve.router`) and one process of fake nodes registered with
    each; `procs` by name: router0, router1, ..., fakes."""

    ports: list[int]
    control_ports: list[int]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # the cores this process may use when the rig starts, before a benchmark pins anything
    cpus: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0)))

    @property
    def routers(self) -> list[subprocess.Popen]:
        return [self.procs[f"router{i}"] for i in range(len(self.ports))]


@contextmanager
def routers_over_fakes(
    model: Path,
    routers: int,
    fakes: dict[str, Any],
    log_dir: Path,
    router_args: Sequence[str] = (),
    timeout: float = 90.0,
) -> Iterator[RoutersOverFakes]:
    """`routers` routers serving `model`'s tokenizer as "router-bench", then the fake nodes
    (`pdserve.testbed.fake_nodes`, spec `fakes` and the routers' control addresses); yields
    once every router counts the fake nodes live."""
    rig = RoutersOverFakes([free_port() for _ in range(routers)],
                           [free_port() for _ in range(routers)])  # fmt: skip
    with ExitStack() as stack:
        for i, (port, control) in enumerate(zip(rig.ports, rig.control_ports)):
            cmd = [sys.executable, "-m", "pdserve.router", str(model), "--host", HOST]
            cmd += ["--served-model-name", "router-bench", "--port", str(port)]
            cmd += ["--control-port", str(control), *router_args]
            router = process_group(cmd, log_dir / f"router{i}.log")
            rig.procs[f"router{i}"] = stack.enter_context(router)
        spec = {**fakes, "routers": [f"{HOST}:{c}" for c in rig.control_ports]}
        fakes_log = log_dir / "fakes.log"
        rig.procs["fakes"] = stack.enter_context(process_group(fake_nodes.command(spec), fakes_log))
        want = f"pdserve_backend_nodes_colocated {float(fakes['nodes'])}"
        deadline = time.monotonic() + timeout
        for port in rig.ports:
            url = f"http://{HOST}:{port}/metrics"
            ready = functools.partial(http_ok, url, want)
            left = max(0.0, deadline - time.monotonic())
            wait_until(ready, rig.procs, left, f"router at {url} (logs in {log_dir})")
        yield rig

"""Start a router plus N prefill and M decode nodes (or colocated nodes) on this host.

Used by scripts/launch_local.sh, the demo, the benchmarks and the end-to-end tests:
`pdserve serve MODEL --num-prefill 1 --num-decode 1`.
Runs in the foreground and stops every child on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """Child processes of one local deployment; `with LocalCluster(...) as c:` waits for
    /health and stops everything on exit."""

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    kv_connector: str = "zmq"
    port: int = 0
    control_port: int = 0
    engine_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    log_dir: str | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.control_port = self.control_port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str]) -> None:
        out = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "wb")  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )

    def start(self, timeout: float = 120.0) -> LocalCluster:
        router = f"127.0.0.1:{self.control_port}"
        self._spawn(
            "router",
            [
                "router",
                "--model",
                self.model,
                "--port",
                str(self.port),
                "--control-port",
                str(self.control_port),
                *self.router_args,
            ],
        )
        node = ["--model", self.model, "--router", router, *self.engine_args]
        for i in range(self.num_prefill):
            self._spawn(
                f"prefill{i}",
                [
                    "prefill",
                    *node,
                    "--node-id",
                    f"prefill{i}",
                    "--kv-connector",
                    self.kv_connector,
                    *self.prefill_args,
                ],
            )
        for i in range(self.num_decode):
            self._spawn(
                f"decode{i}",
                [
                    "decode",
                    *node,
                    "--node-id",
                    f"decode{i}",
                    "--kv-connector",
                    self.kv_connector,
                    *self.decode_args,
                ],
            )
        for i in range(self.num_colocated):
            self._spawn(f"both{i}", ["decode", "--role", "both", *node, "--node-id", f"both{i}"])
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until /health says 200 and every node has registered; RuntimeError otherwise."""
        deadline = time.monotonic() + timeout
        want = self.num_prefill + self.num_decode + self.num_colocated
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"processes exited during start: {dead}")
            try:
                if self.get("/health") is not None and len(self.integrity()) == want:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready after {timeout}s")

    def get(self, path: str, timeout: float = 10.0) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError:
            return None

    def integrity(self) -> dict:
        return self.get("/internal/integrity") or {}

    def stop(self, timeout: float = 15.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="pdserve: router + prefill + decode on this host")
    p.add_argument("--model", required=True)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--num-colocated", type=int, default=0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--control-port", type=int, default=8100)
    p.add_argument("--kv-connector", default="zmq", choices=["zmq", "nccl", "shm"])
    p.add_argument("--log-dir", default=None)
    args, engine_args = p.parse_known_args(argv)
    cluster = LocalCluster(
        args.model,
        args.num_prefill,
        args.num_decode,
        args.num_colocated,
        args.kv_connector,
        args.port,
        args.control_port,
        engine_args=engine_args,
        log_dir=args.log_dir,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        print(f"pdserve ready at {cluster.url} (Ctrl-C to stop)", flush=True)
        while not stop.is_set():
            if any(proc.poll() is not None for proc in cluster.procs.values()):
                print("a pdserve process exited; stopping", file=sys.stderr)
                break
            stop.wait(0.5)


if __name__ == "__main__":
    main()

"""pdserve's roles on separate hosts (network namespaces, `pdserve.testbed.hosts`).

`HostCluster` starts `pdserve router|prefill|decode` processes inside hosts, the way an
operator would on separate machines: routers bind their host's address, nodes bind 0.0.0.0
and advertise the address of their interface (`--advertise-host` defaults to the route to the
first router), and every node registers with every router given. The multi-host tests and
`pdserve bench multihost` use it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from pdserve.testbed.hosts import Hosts

ROUTER_PORT = 8000
CONTROL_PORT = 8100
KV_PORT = 8300


@dataclass
class HostCluster:
    """Router and node processes in hosts. Each child is known by a name; its output goes to
    `log_dir/<name>.log`. `close()` stops them all (Hosts.close kills what is left)."""

    hosts: Hosts
    model: str
    log_dir: str
    engine_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # node ids, in order

    def control_addr(self, router_host: str) -> str:
        return f"{self.hosts.addr(router_host)}:{CONTROL_PORT}"

    def url(self, router_host: str) -> str:
        return f"http://{self.hosts.addr(router_host)}:{ROUTER_PORT}"

    def spawn(self, name: str, host: str, args: list[str]) -> subprocess.Popen:
        """Run `python -m pdserve ARGS` in `host` as child `name`."""
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as out:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env.pop("PDSERVE_API_KEY", None)
            proc = self.hosts.popen(
                host,
                [sys.executable, "-m", "pdserve", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.procs[name] = proc
        return proc

    def router(self, host: str, extra: tuple[str, ...] = ()) -> str:
        """A router on `host` (its address, the usual ports); returns its URL."""
        addr = self.hosts.addr(host)
        self.spawn(
            f"router@{host}",
            host,
            ["router", self.model, "--host", addr, "--port", str(ROUTER_PORT)]
            + ["--control-port", str(CONTROL_PORT), *extra],
        )
        return self.url(host)

    def node(
        self,
        role: str,
        host: str,
        routers: list[str],
        connector: str = "zmq",
        extra: tuple[str, ...] = (),
    ) -> str:
        """A prefill, decode or colocated ("both") node on `host`, bound to 0.0.0.0,
        registered with the routers on `routers` (hosts); returns its node id."""
        node_id = f"{role}@{host}"
        n = sum(1 for name in self.started if name.split("~")[0] == node_id)
        node_id += f"~{n + 1}" if n else ""  # a new node: the router forgets the old later
        self.started.append(node_id)
        args = ["prefill"] if role == "prefill" else ["decode"]
        if role == "both":
            args += ["--role", "both"]
        args += [self.model, "--node-id", node_id, "--host", "0.0.0.0"]
        args += ["--kv-connector", connector, *self.engine_args]
        if role == "decode":
            args += ["--kv-port", str(KV_PORT)]
        for r in routers:
            args += ["--router", self.control_addr(r)]
        self.spawn(node_id, host, [*args, *extra])
        return node_id

    def integrity(self, router_host: str) -> dict:
        # Plain HTTP: verify=False loads no CA bundle (~25 ms of CPU a client; wait_ready polls).
        resp = httpx.get(self.url(router_host) + "/internal/integrity", timeout=30, verify=False)
        resp.raise_for_status()
        return resp.json()

    def wait_ready(
        self, router_host: str, node_ids: list[str], timeout: float = 120.0, routable=True
    ) -> None:
        """Until the router answers (/health with routable, /live otherwise) and knows every
        node in node_ids; RuntimeError naming a child that exited meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"exited: {dead} (logs in {self.log_dir})")
            try:
                path = "/health" if routable else "/live"
                resp = httpx.get(self.url(router_host) + path, timeout=5, verify=False)
                up = resp.status_code == 200
                if up and set(node_ids) <= set(self.integrity(router_host)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"router on {router_host} not ready after {timeout}s")

    def stop(self, name: str, timeout: float = 15.0) -> int:
        """SIGTERM one child (a node drains) and wait; SIGKILL when it does not end."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.terminate()
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait(5)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def log(self, name: str) -> str:
        with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
            return f.read()


# -- the benchmark ---------------------------------------------------------------------------

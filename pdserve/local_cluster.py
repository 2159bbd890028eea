"""The child processes of one deployment on this host: a router plus N prefill and M decode
nodes (or colocated nodes), each `python -m pdserve <role> ...`.

`LocalCluster` starts them and waits until the router answers and every node registered; the
tests, the demo and the benchmarks use it directly, and `pdserve serve` supervises one (see
`pdserve.serve`). Every child is described by a name and its command line, so a supervisor
can start the same child again.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from pdserve import placement
from pdserve.testbed import zygote


def exit_status(returncode: int) -> str:
    """A child's exit in words: `exit code 1`, `killed by SIGKILL`."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """Child processes of one local deployment; `with LocalCluster(...) as c:` waits for
    /health and stops everything on exit.

    Child output goes to `log_dir/<name>.log` when log_dir is set, to this process's own
    stdout/stderr when inherit_output is set, else nowhere. With own_process_group the children
    do not get the terminal's Ctrl-C: only `stop()` signals them (one SIGTERM: a node drains;
    a second one would stop it at once), as a supervisor wants. With num_routers > 1 every
    node registers with each router; routers after the first ("router1", ...) take free ports.
    `node_args` adds arguments to single nodes ("prefill0": a TP group, say), last, so that
    they win over the shared ones. `placement` "auto" pins each child to its share of `cpus`
    (`pdserve.placement.plan`, over the children of the moment), "off" leaves them to the
    kernel.
    """

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    num_routers: int = 1
    kv_connector: str = "zmq"
    port: int = 0
    control_port: int = 0
    engine_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    node_args: dict[str, list[str]] = field(default_factory=dict)  # by name, after the rest
    log_dir: str | None = None
    host: str = "127.0.0.1"
    inherit_output: bool = False
    own_process_group: bool = False
    api_key: str | None = None  # the router's (given to it by environment, not in `ps`)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    more_routers: list[tuple[int, int]] = field(default_factory=list)  # (port, control port)
    added: dict[str, str] = field(default_factory=dict)  # nodes added since: name -> role
    removed: set[str] = field(default_factory=set)  # nodes gone for good (drained, stopped)
    placement: str = placement.DEFAULT_PLACEMENT
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))

    def __post_init__(self) -> None:
        if self.placement not in placement.PLACEMENTS:
            raise ValueError(
                f"cpu placement {self.placement!r} is none of {', '.join(placement.PLACEMENTS)}"
            )
        if self.num_routers < 1:
            raise ValueError(f"a deployment needs at least one router, got {self.num_routers}")
        self.port = self.port or free_port()
        self.control_port = self.control_port or free_port()
        more = self.num_routers - 1 - len(self.more_routers)
        self.more_routers += [(free_port(), free_port()) for _ in range(more)]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def urls(self) -> list[str]:
        """Every router's URL, the first one's first."""
        host = self.url.rsplit(":", 1)[0]
        return [self.url, *(f"{host}:{port}" for port, _ in self.more_routers)]

    @property
    def node_names(self) -> list[str]:
        return [n for n in self.children() if not n.startswith("router")]

    def children(self) -> dict[str, list[str]]:
        """Every child by name: the arguments after `python -m pdserve`."""
        routers = [(self.port, self.control_port), *self.more_routers]
        node = ["--model", self.model]
        for _, control in routers:
            node += ["--router", f"127.0.0.1:{control}"]
        node += self.engine_args
        kv = ["--kv-connector", self.kv_connector]
        out = {}
        for i, (port, control) in enumerate(routers):
            out[f"router{i or ''}"] = self._router(port, control)
        roles = [("prefill", f"prefill{i}") for i in range(self.num_prefill)]
        roles += [("decode", f"decode{i}") for i in range(self.num_decode)]
        for role, name in roles + [(role, name) for name, role in self.added.items()]:
            extra = self.prefill_args if role == "prefill" else self.decode_args
            out[name] = [role, *node, "--node-id", name, *kv, *extra]
        for i in range(self.num_colocated):
            out[f"both{i}"] = ["decode", "--role", "both", *node, "--node-id", f"both{i}"]
        for name, args in self.node_args.items():
            if name not in out:
                raise ValueError(f"node_args names {name!r}, not a node of this cluster")
            out[name] = out[name] + args
        return {name: args for name, args in out.items() if name not in self.removed}

    def add_node(self, role: str) -> str:
        """One more node of `role` (prefill or decode), under a name never used here; its name.
        `spawn` starts it."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"a node added to a P/D deployment is prefill or decode, not {role}")
        used = set(self.children()) | self.removed
        name = next(f"{role}{i}" for i in itertools.count() if f"{role}{i}" not in used)
        self.added[name] = role
        return name

    def remove_node(self, name: str) -> None:
        """Forget node `name` (it has exited): no child of that name from now on."""
        self.removed.add(name)
        self.procs.pop(name, None)

    def cores(self) -> dict[str, tuple[int, ...]]:
        """The cores of each child that is pinned, by name (none with placement off)."""
        if self.placement == "off":
            return {}
        names = list(self.children())
        roles = [[n for n in names if n.startswith(r)] for r in ("prefill", "decode", "both")]
        share = placement.plan(self.cpus, *roles)
        routers = share.pop("router", None)
        if routers:
            share.update((n, routers) for n in names if n.startswith("router"))
        return share

    def _router(self, port: int, control_port: int) -> list[str]:
        out = ["router", "--model", self.model, "--host", self.host, "--port", str(port)]
        out += ["--control-host", "127.0.0.1", "--control-port", str(control_port)]
        return out + self.router_args

    def spawn(self, name: str) -> subprocess.Popen:
        """Start child `name` (again): a restart appends to its log."""
        out = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        elif self.inherit_output:
            out = None
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PDSERVE_API_KEY", None)
        if name == "router" and self.api_key:
            env["PDSERVE_API_KEY"] = self.api_key
        cpus = self.cores().get(name)
        if cpus and not name.startswith("router"):
            env = placement.threads_env(cpus, env)
        with placement.inherited(cpus):  # an exec'd child starts on its cores
            proc = self._forked(name, env, out) or self._exec(name, env, out)
        if cpus:
            placement.pin(proc.pid, cpus)  # a forked one (the launcher's child) moves there
        if out not in (None, subprocess.DEVNULL):
            out.close()  # the child holds its own descriptor
        self.procs[name] = proc
        return proc

    def _exec(self, name: str, env: dict[str, str], out: Any) -> subprocess.Popen:
        args = [sys.executable, "-m", "pdserve", *self.children()[name]]
        group = 0 if self.own_process_group else None
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=group
        )

    def _forked(self, name: str, env: dict[str, str], out: Any) -> subprocess.Popen | None:
        """The child forked by the test suite's launcher, where one runs for this process
        (pdserve.testbed.zygote: the same process without a fresh interpreter's imports)."""
        if zygote.ENV not in os.environ:
            return None
        env.pop(zygote.ENV, None)
        null = os.open(os.devnull, os.O_WRONLY) if out == subprocess.DEVNULL else None
        try:
            fd = null if null is not None else (None if out is None else out.fileno())
            return zygote.fork(self.children()[name], env, fd, self.own_process_group)
        finally:
            if null is not None:
                os.close(null)

    def start(self, timeout: float = 120.0, routable: bool = True) -> LocalCluster:
        """Start every child; wait until they registered (and, with routable, until the
        router has a route for requests: /health)."""
        for name in self.children():
            self.spawn(name)
        self.wait_ready(timeout, routable)
        return self

    def wait_ready(self, timeout: float, routable: bool = True) -> None:
        """Until /health says 200 (with routable) and every node has registered; RuntimeError
        otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready(routable):
                return
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready after {timeout}s")

    def ready(self, routable: bool = True) -> bool:
        """One look: the router answers /health (with routable: /live otherwise) and every
        node has registered. RuntimeError when a child has exited (it says which, how, and
        where its log is)."""
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"exited during start: {self._describe(dead)}")
        try:
            up = self.get("/health" if routable else "/live") is not None
            return up and len(self.integrity()) == len(self.node_names)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _describe(self, dead: dict[str, int]) -> str:
        where = f" (logs in {self.log_dir})" if self.log_dir else ""
        return ", ".join(f"{n} ({exit_status(rc)})" for n, rc in dead.items()) + where

    def get(self, path: str, timeout: float = 10.0) -> dict | None:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            request = urllib.request.Request(self.url + path, headers=auth)
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError:
            return None

    def integrity(self) -> dict:
        # Longer than the router's reply timeout (10 s): a node that exited unnoticed answers
        # nothing, and the router reports it without a report instead of failing the call.
        return self.get("/internal/integrity", timeout=30.0) or {}

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every child (nodes drain), wait up to timeout, then kill what is left."""
        self.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def terminate(self) -> None:
        """SIGTERM every running child (a second one stops a draining node at once)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

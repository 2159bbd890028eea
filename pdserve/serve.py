"""`pdserve serve MODEL`: the whole deployment on this host, in the foreground, supervised.

A router plus N prefill and M decode nodes (or N colocated nodes) run as child processes
(`pdserve.local_cluster.LocalCluster`). The supervisor restarts a child that exits, after an
exponential backoff and up to a restart limit, logging each exit with its status; the router
serves from the surviving nodes meanwhile, and nodes register again with a restarted router by
themselves. SIGINT/SIGTERM stop restarts and drain every child.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.node.cli import (
    KV_CONNECTORS,
    add_engine_args,
    add_model_arg,
    parser,
    resolve_model,
)
from pdserve.local_cluster import LocalCluster

log = logging.getLogger("pdserve.serve")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before restart number n (1-based) of a child that keeps failing: initial, doubled
    each time, capped at maximum. A child that stayed up reset_after seconds starts over."""

    initial: float = 1.0
    maximum: float = 30.0
    reset_after: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, failures - 1))


@dataclass(slots=True)
class Child:
    """The supervisor's bookkeeping for one child (pure: no processes in here)."""

    name: str
    started_at: float = 0.0
    failures: int = 0  # consecutive quick exits (reset when it stayed up)
    restarts: int = 0  # restarts so far
    restart_at: float | None = None  # when to start it again (None: running or given up)
    given_up: bool = False

    def exited(self, now: float, backoff: Backoff, max_restarts: int) -> float | None:
        """Record an exit; the delay before the restart, or None when the limit is reached."""
        if now - self.started_at >= backoff.reset_after:
            self.failures = 0
        self.failures += 1
        if self.restarts >= max_restarts:
            self.given_up = True
            self.restart_at = None
            return None
        delay = backoff.delay(self.failures)
        self.restart_at = now + delay
        return delay

    def started(self, now: float, restart: bool) -> None:
        self.started_at = now
        self.restart_at = None
        self.restarts += restart


def exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Supervisor:
    """Keeps a LocalCluster's children running; `poll()` is one round (called by `run`)."""

    def __init__(
        self,
        cluster: LocalCluster,
        max_restarts: int = 10,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        self.cluster = cluster
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.clock = clock
        self.children = {name: Child(name) for name in cluster.children()}
        self.failed: str | None = None  # why the whole deployment must stop
        self._metrics: _Metrics | None = None

    def start(self, timeout: float) -> None:
        now = self.clock()
        for child in self.children.values():
            child.started(now, restart=False)
        self.cluster.start(timeout)
        self._publish()

    def poll(self) -> None:
        now = self.clock()
        for name, child in self.children.items():
            proc = self.cluster.procs.get(name)
            if child.restart_at is not None:
                if now >= child.restart_at:
                    log.info("restarting %s (restart %d)", name, child.restarts + 1)
                    self.cluster.spawn(name)
                    child.started(now, restart=True)
            elif not child.given_up and proc is not None and proc.poll() is not None:
                self._on_exit(child, proc.returncode, now)
        self._publish()

    def _on_exit(self, child: Child, returncode: int, now: float) -> None:
        status = exit_status(returncode)
        delay = child.exited(now, self.backoff, self.max_restarts)
        if delay is not None:
            log.warning("%s exited (%s); restarting in %.1f s", child.name, status, delay)
            return
        log.error("%s exited (%s) after %d restarts: left down", child.name, status, child.restarts)
        if child.name == "router":
            self.failed = f"the router exited {child.restarts + 1} times"

    def up(self, name: str) -> bool:
        proc = self.cluster.procs.get(name)
        return proc is not None and proc.poll() is None

    def run(self, stop: threading.Event, interval: float = 0.2) -> None:
        """Supervise until stop is set or the router cannot be kept up."""
        while not stop.wait(interval) and self.failed is None:
            self.poll()

    def stop(self, timeout: float) -> None:
        self.cluster.stop(timeout)
        self._publish()

    def serve_metrics(self, port: int, host: str) -> int:
        self._metrics = _Metrics(port, host)
        self._publish()
        return self._metrics.port

    def _publish(self) -> None:
        if self._metrics is not None:
            for name, child in self.children.items():
                self._metrics.set(name, self.up(name), child.restarts)


class _Metrics:
    """The supervisor's own Prometheus endpoint: each child's state and restarts."""

    def __init__(self, port: int, host: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.up = Gauge(
            "pdserve_supervisor_child_up",
            "1 while the child process runs",
            ["child"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "pdserve_supervisor_child_restarts",
            "restarts of the child",
            ["child"],
            registry=self.registry,
        )
        self._seen: dict[str, int] = {}
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_port

    def set(self, name: str, up: bool, restarts: int) -> None:
        self.up.labels(child=name).set(1.0 if up else 0.0)
        counter = self.restarts.labels(child=name)
        counter.inc(restarts - self._seen.get(name, 0))
        self._seen[name] = restarts


def _forwarded(args: argparse.Namespace, group: argparse._ArgumentGroup) -> list[str]:
    """The engine flags given on this command line, spelled again for the nodes."""
    out = []
    for action in group._group_actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if action.nargs == 0 else [flag, str(value)]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve serve",
        "Serve MODEL on this host: a router (OpenAI-compatible HTTP API) plus prefill and decode\n"
        "nodes as supervised child processes. Ctrl-C (or SIGTERM) drains and stops them all.",
    )
    add_model_arg(p)
    topo = p.add_argument_group("deployment")
    topo.add_argument("--num-prefill", type=int, default=None, help="prefill nodes (default: 1)")
    topo.add_argument("--num-decode", type=int, default=None, help="decode nodes (default: 1)")
    topo.add_argument(
        "--colocated", type=int, default=0, help="colocated nodes instead of prefill/decode"
    )
    topo.add_argument(
        "--kv-connector", default="zmq", choices=KV_CONNECTORS, help="how KV pages travel P -> D"
    )
    api = p.add_argument_group("HTTP API")
    api.add_argument("--host", default="127.0.0.1", help="address the API listens on")
    api.add_argument("--port", type=int, default=8000, help="HTTP port")
    api.add_argument("--control-port", type=int, default=8100, help="port nodes register on")
    api.add_argument("--api-key", default=None, help="Bearer key every route but /health needs")
    api.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: MODEL)"
    )
    sup = p.add_argument_group("supervisor")
    sup.add_argument(
        "--max-restarts", type=int, default=10, help="restarts per child before it is left down"
    )
    sup.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        help="seconds before a first restart; doubled per quick exit, up to 30",
    )
    sup.add_argument(
        "--supervisor-metrics-port",
        type=int,
        default=None,
        help="serve the children's state as Prometheus metrics on this port (0: a free one)",
    )
    sup.add_argument("--log-dir", default=None, help="one log file per child (default: stdout)")
    sup.add_argument("--start-timeout", type=float, default=300.0, help="seconds to be ready")
    extra = p.add_argument_group("more flags for the children")
    extra.add_argument("--router-flags", default="", help="extra router flags, one string")
    extra.add_argument("--node-flags", default="", help="extra flags for every node, one string")
    add_engine_args(p)
    return p


def cluster_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> LocalCluster:
    resolve_model(p, args)
    if args.colocated and (args.num_prefill or args.num_decode):
        p.error("--colocated N replaces --num-prefill/--num-decode: give one or the other")
    num_p = 0 if args.colocated else (1 if args.num_prefill is None else args.num_prefill)
    num_d = 0 if args.colocated else (1 if args.num_decode is None else args.num_decode)
    if not args.colocated and (num_p < 1 or num_d < 1):
        p.error("a P/D deployment needs at least one prefill and one decode node")
    engine = []
    for group in p._action_groups:
        if group.title in ("model", "KV cache", "scheduler"):
            engine += _forwarded(args, group)
    router = shlex.split(args.router_flags)
    if args.api_key:
        router += ["--api-key", args.api_key]
    if args.served_model_name:
        router += ["--served-model-name", args.served_model_name]
    if args.max_model_len:
        router += ["--max-model-len", str(args.max_model_len)]
    return LocalCluster(
        args.model,
        num_prefill=num_p,
        num_decode=num_d,
        num_colocated=args.colocated,
        kv_connector=args.kv_connector,
        port=args.port,
        control_port=args.control_port,
        engine_args=engine + shlex.split(args.node_flags),
        router_args=router,
        log_dir=args.log_dir,
        host=args.host,
        inherit_output=args.log_dir is None,
    )


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    cluster = cluster_from_args(p, args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sup = Supervisor(cluster, args.max_restarts, Backoff(initial=args.restart_backoff))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.supervisor_metrics_port is not None:
            port = sup.serve_metrics(args.supervisor_metrics_port, args.host)
            log.info("supervisor metrics at http://%s:%d/metrics", args.host, port)
        sup.start(args.start_timeout)
        nodes = ", ".join(cluster.node_names)
        log.info("pdserve ready at %s (router, %s); Ctrl-C to stop", cluster.url, nodes)
        print(f"pdserve ready at {cluster.url}", flush=True)
        sup.run(stop)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        log.error("%s", exc)
        sup.failed = str(exc)
    finally:
        log.info("stopping every child")
        sup.stop(timeout=30.0)
    if sup.failed:
        sys.exit(f"pdserve serve: {sup.failed}")

"""`pdserve serve MODEL`: the whole deployment on this host, in the foreground, supervised.

A router plus N prefill and M decode nodes (or N colocated nodes) run as child processes
(`pdserve.local_cluster.LocalCluster`, in their own process group: only the supervisor signals
them). The supervisor restarts a child that exits, after an exponential backoff and up to a
restart limit, logging each change of state with the exit status; the router serves from the
surviving nodes meanwhile, and the nodes register again with a restarted router by themselves
(a restarted node keeps its `--node-id`, so the router knows it for a restart). SIGINT, SIGTERM
or SIGHUP stop restarts and drain every child; a second signal stops them at once.

The bookkeeping (`Backoff`, `Child`) is pure; `Supervisor.poll()` is one round over the
children with an injectable clock, so both are tested without processes.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.node.cli import (
    add_engine_args,
    add_model_arg,
    add_options,
    option_flags,
    options_of,
    parser,
    resolve_model,
)
from pdserve.common.node.config import NodeConfig
from pdserve.common.options import option
from pdserve.local_cluster import LocalCluster, exit_status
from pdserve.router.config import add_router_args, router_config

__all__ = ["Backoff", "Child", "StopFlag", "Supervisor", "build_parser", "exit_status", "main"]

log = logging.getLogger("pdserve.serve")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 15.0  # beyond the nodes' drain timeout, before what is left gets SIGKILL
MAX_RESTARTS = 10  # --max-restarts' default and Supervisor's
SUPERVISOR = "supervisor"  # the help group of the supervisor's flags


class StopFlag:
    """Set by a signal handler, polled by the supervising loop. Not a `threading.Event`: its
    `set()` takes the lock that an `Event.wait()` interrupted by the signal may hold in the same
    (main) thread, and then waits for it forever."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, seconds: float) -> bool:
        """Sleep unless set (a signal ends the sleep late by at most `seconds`); is it set?"""
        if not self._set:
            time.sleep(seconds)
        return self._set


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before the n-th restart in a row (1-based) of a child that keeps failing:
    initial, doubled each time, capped at maximum. An exit after the child stayed up
    reset_after seconds does not count as failing: the series starts over."""

    initial: float = option(
        1.0, SUPERVISOR, "seconds before a first restart", flag="--restart-backoff"
    )
    maximum: float = option(
        30.0,
        SUPERVISOR,
        "seconds: the backoff doubles per exit in a row up to this",
        flag="--restart-backoff-max",
    )
    reset_after: float = option(
        60.0,
        SUPERVISOR,
        "seconds a child must stay up for its backoff and restart count to start over",
        flag="--restart-reset",
    )

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {self}")
        if not self.reset_after > 0:
            raise ValueError(f"backoff reset_after must be > 0 seconds, got {self.reset_after}")

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2 ** max(0, failures - 1))


@dataclass(slots=True)
class Child:
    """The supervisor's bookkeeping for one child (pure: no processes in here)."""

    name: str
    started_at: float = 0.0
    failures: int = 0  # exits in a row, each within backoff.reset_after of its start
    restarts: int = 0  # restarts so far (the metric)
    restart_at: float | None = None  # when to start it again (None: running or given up)
    given_up: bool = False

    def exited(self, now: float, backoff: Backoff, max_restarts: int) -> float | None:
        """Record an exit; the delay before the restart, or None once the child failed more
        than max_restarts times in a row (it is then left down)."""
        if now - self.started_at >= backoff.reset_after:
            self.failures = 0
        self.failures += 1
        if self.failures > max_restarts:
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


class Supervisor:
    """Keeps a LocalCluster's children running; `poll()` is one round (called by `run`)."""

    def __init__(
        self,
        cluster: LocalCluster,
        max_restarts: int = MAX_RESTARTS,
        backoff: Backoff = Backoff(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.cluster = cluster
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.clock = clock
        self.children = {name: Child(name) for name in cluster.children()}
        self.failed: str | None = None  # why the whole deployment must stop
        self.stopping = False  # set first thing on shutdown: no restarts from then on
        self._metrics: _Metrics | None = None

    def start(self, timeout: float, stop: StopFlag) -> bool:
        """Start every child and wait until the cluster is ready: True; False when stop was
        set first. RuntimeError when a child exits during start or on timeout (a child that
        cannot start is a setup error, not a crash to retry)."""
        now = self.clock()
        for name, child in self.children.items():
            proc = self.cluster.spawn(name)
            child.started(now, restart=False)
            log.info("%s started (pid %d)", name, proc.pid)
        self._publish()
        deadline = time.monotonic() + timeout
        while not self.cluster.ready():
            if stop.wait(0.2):
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout:.0f} s")
        return True

    def poll(self) -> None:
        """One round: note exits, restart children whose backoff has passed."""
        if self.stopping:
            return
        now = self.clock()
        for name, child in self.children.items():
            proc = self.cluster.procs.get(name)
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child, now)
            elif not child.given_up and proc is not None and proc.poll() is not None:
                self._on_exit(child, exit_status(proc.returncode), now)
        self._publish()

    def _restart(self, child: Child, now: float) -> None:
        try:
            proc = self.cluster.spawn(child.name)
        except OSError as exc:  # fork failed (memory, process limit): count it as an exit
            self._on_exit(child, f"could not start: {exc}", now)
            return
        child.started(now, restart=True)
        log.info("%s restarted (pid %d, restart %d)", child.name, proc.pid, child.restarts)

    def _on_exit(self, child: Child, status: str, now: float) -> None:
        delay = child.exited(now, self.backoff, self.max_restarts)
        if delay is not None:
            log.warning("%s exited (%s); restarting in %.1f s", child.name, status, delay)
            return
        log.error(
            "%s exited (%s), %d times in a row: left down", child.name, status, child.failures
        )
        if child.name == "router":
            self.failed = f"the router exited {child.failures} times in a row ({status})"

    def up(self, name: str) -> bool:
        proc = self.cluster.procs.get(name)
        return proc is not None and proc.poll() is None

    def run(self, stop: StopFlag, interval: float = 0.2) -> None:
        """Supervise until stop is set or the router cannot be kept up."""
        while not stop.wait(interval) and self.failed is None:
            self.poll()

    def stop(self, timeout: float) -> None:
        """SIGTERM every child (nodes drain), wait up to timeout, SIGKILL what is left."""
        self.stopping = True
        log.info("stopping: SIGTERM to every child, up to %.0f s to drain", timeout)
        self.cluster.stop(timeout)
        for name, proc in self.cluster.procs.items():
            if proc.returncode is not None:  # uvicorn ends by re-raising the SIGTERM it handled
                rc = proc.returncode
                status = "on SIGTERM" if rc == -signal.SIGTERM else exit_status(rc)
                log.info("%s stopped (%s)", name, status)
        self._publish()

    def serve_metrics(self, port: int, host: str) -> int:
        self._metrics = _Metrics(port, host)
        self._publish()
        return self._metrics.port

    def _publish(self) -> None:
        if self._metrics is not None:
            for name, child in self.children.items():
                self._metrics.set(name, self.up(name), child.given_up, child.restarts)


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
        self.given_up = Gauge(
            "pdserve_supervisor_child_given_up",
            "1 once the child passed its restart limit and is left down",
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

    def set(self, name: str, up: bool, given_up: bool, restarts: int) -> None:
        self.up.labels(child=name).set(1.0 if up else 0.0)
        self.given_up.labels(child=name).set(1.0 if given_up else 0.0)
        self.restarts.labels(child=name).inc(restarts - self._seen.get(name, 0))
        self._seen[name] = restarts


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given on this command line (not at their defaults), spelled again for
    the nodes; the flags are those `add_engine_args` defines, so the list never drifts."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    out = []
    for action in engine._actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            flag = action.option_strings[0 if value else 1]
        out += [flag] if action.nargs == 0 else [flag, str(value)]
    return out


# The router flags `pdserve serve` leaves out: --control-host, since its nodes reach the router
# on 127.0.0.1 (LocalCluster binds control there), and --max-model-len, which is the engine flag
# of that name here, for the router and every node alike.
SERVE_OMITS = frozenset({"control_host", "max_model_len"})
# Router settings LocalCluster spells itself (the API key by environment, never in `ps`).
CLUSTER_SETS = frozenset({"host", "port", "control_host", "control_port", "api_key"})
# The node flags `pdserve serve` takes itself and hands on to every node.
NODE_OPTIONS = frozenset(
    {"tensor_parallel_size", "threads_per_rank", "kv_connector", "drain_timeout"}
)


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "pdserve serve",
        "Serve MODEL on this host: a router (OpenAI-compatible HTTP API) plus prefill and decode\n"
        "nodes as supervised child processes: a child that exits is restarted (the router too).\n"
        "Ctrl-C (or SIGTERM) drains and stops them all (what still runs "
        f"{STOP_GRACE_S:.0f} s past\n--drain-timeout is killed); a second Ctrl-C stops them "
        "at once.",
    )
    add_model_arg(p)
    _add_deployment_args(p)
    add_options(p, NodeConfig, only=NODE_OPTIONS)
    add_router_args(p, omit=SERVE_OMITS)
    _add_supervisor_args(p)
    _add_child_flag_args(p)
    add_engine_args(p)
    return p


def _add_deployment_args(p: argparse.ArgumentParser) -> None:
    """How many nodes of each role, their tensor parallelism, connector and drain."""
    topo = p.add_argument_group("deployment")
    topo.add_argument(
        "--num-prefill", type=int, default=None, metavar="N", help="prefill nodes (default: 1)"
    )
    topo.add_argument(
        "--num-decode", type=int, default=None, metavar="M", help="decode nodes (default: 1)"
    )
    topo.add_argument(
        "--colocated",
        type=int,
        default=0,
        metavar="N",
        help="N colocated nodes (prefill and decode in one engine) instead of P/D nodes",
    )
    topo.add_argument(
        "--num-routers",
        type=int,
        default=1,
        metavar="R",
        help="routers, every node registered with each; the first on --port, the others on "
        "free ports (named router1, ...; default: 1)",
    )
    topo.add_argument(
        "--prefill-tp", type=int, default=None, metavar="N", help="prefill nodes' TP (default: -tp)"
    )
    topo.add_argument(
        "--decode-tp", type=int, default=None, metavar="N", help="decode nodes' TP (default: -tp)"
    )


def _add_supervisor_args(p: argparse.ArgumentParser) -> None:
    """How the supervisor restarts, reports, logs and waits for its children."""
    sup = p.add_argument_group(SUPERVISOR)
    sup.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help="restarts of a child that exits again and again (each within --restart-reset s "
        "of its start) before it is left down; for the router, everything stops",
    )
    add_options(p, Backoff)  # into the group above
    sup.add_argument(
        "--supervisor-metrics-port",
        type=int,
        default=None,
        help="serve each child's state as Prometheus metrics on --host:PORT (0: a free port; "
        "default: off)",
    )
    sup.add_argument("--log-dir", default=None, help="one log file per child (default: stdout)")
    sup.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds for every child to be ready"
    )


def _add_child_flag_args(p: argparse.ArgumentParser) -> None:
    """Free-form flags passed on to the router and the nodes as given."""
    extra = p.add_argument_group("more flags for the children")
    extra.add_argument(
        "--router-flags",
        default="",
        help='extra `pdserve router` flags, one quoted string, e.g. "--heartbeat-timeout 2" '
        "(default: none)",
    )
    extra.add_argument(
        "--node-flags", default="", help="extra flags for every node, one string (default: none)"
    )


def _tp_flags(
    p: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[str], list[str]]:
    """The tensor-parallel flags of every node, of prefill nodes and of decode nodes."""
    sizes = (args.tensor_parallel_size, args.prefill_tp, args.decode_tp)
    if any(n is not None and n < 1 for n in sizes):
        p.error("tensor-parallel sizes must be >= 1")
    every = ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.threads_per_rank is not None:
        every += ["--threads-per-rank", str(args.threads_per_rank)]
    role = [[] if n is None else ["--tensor-parallel-size", str(n)] for n in sizes[1:]]
    return every, role[0], role[1]


def cluster_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> LocalCluster:
    """The deployment of parsed `build_parser` flags (ValueError on a bad router flag)."""
    resolve_model(p, args)
    if args.colocated and (args.num_prefill or args.num_decode):
        p.error("--colocated N replaces --num-prefill/--num-decode: give one or the other")
    if args.colocated < 0:
        p.error("--colocated must be >= 0")
    num_p = 0 if args.colocated else (1 if args.num_prefill is None else args.num_prefill)
    num_d = 0 if args.colocated else (1 if args.num_decode is None else args.num_decode)
    if not args.colocated and (num_p < 1 or num_d < 1):
        p.error("a P/D deployment needs at least one prefill and one decode node")
    if args.num_routers < 1:
        p.error("--num-routers must be >= 1")
    router = router_config(args)
    nodes = _engine_flags(args) + ["--drain-timeout", str(args.drain_timeout)]
    if router.curve_dir:
        nodes += ["--curve-dir", router.curve_dir]
    tp = _tp_flags(p, args)
    return LocalCluster(
        args.model,
        num_prefill=num_p,
        num_decode=num_d,
        num_colocated=args.colocated,
        num_routers=args.num_routers,
        kv_connector=args.kv_connector,
        port=router.port,
        control_port=router.control_port,
        engine_args=nodes + tp[0] + shlex.split(args.node_flags),
        prefill_args=tp[1],
        decode_args=tp[2],
        router_args=option_flags(router, CLUSTER_SETS) + shlex.split(args.router_flags),
        log_dir=args.log_dir,
        host=router.host,
        inherit_output=args.log_dir is None,
        own_process_group=True,
        api_key=router.api_key,
    )


def supervisor_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Supervisor:
    try:
        backoff = options_of(Backoff, args)
        return Supervisor(cluster_from_args(p, args), args.max_restarts, backoff)
    except ValueError as exc:
        p.error(str(exc))


def _on_stop_signals(sup: Supervisor, stop: StopFlag) -> None:
    """First signal: leave the supervising loop (main then drains). Next ones: SIGTERM the
    children again, which stops a draining node at once."""

    def handle(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if not stop.is_set():
            log.info("%s: draining every child (again to stop at once)", name)
            sup.stopping = True
            stop.set()
        else:
            log.warning("%s again: stopping every child at once", name)
            sup.cluster.terminate()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    sup = supervisor_from_args(p, args)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = StopFlag()
    _on_stop_signals(sup, stop)
    try:
        if args.supervisor_metrics_port is not None:
            port = sup.serve_metrics(args.supervisor_metrics_port, args.host)
            log.info("supervisor metrics at http://%s:%d/metrics", args.host, port)
        if sup.start(args.start_timeout, stop):
            nodes = ", ".join(sup.cluster.node_names)
            urls = " ".join(sup.cluster.urls)
            log.info("pdserve ready at %s (routers, %s); Ctrl-C to stop", urls, nodes)
            print(f"pdserve ready at {urls}", flush=True)
            sup.run(stop)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.error("%s", exc)
        sup.failed = str(exc)
    finally:
        sup.stop(args.drain_timeout + STOP_GRACE_S)
    if sup.failed:
        sys.exit(f"pdserve serve: {sup.failed}")

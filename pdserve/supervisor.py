"""The supervisor of `pdserve serve`: it keeps a `LocalCluster`'s children running.

It restarts a child that exits, after an exponential backoff and up to a restart limit,
logging each change of state with the exit status, and drains every child on stop. The
bookkeeping (`Backoff`, `Child`) is pure; `Supervisor.poll()` is one round over the children
with an injectable clock, so both are tested without processes. The command itself (flags,
signals, the deployment they describe) is `pdserve.serve`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.options import option
from pdserve.local_cluster import LocalCluster, exit_status

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["MAX_RESTARTS", "SUPERVISOR", "Backoff", "Child", "StopFlag", "Supervisor"]

# The log of the `pdserve serve` command (what its user reads, and what its tests match).
log = logging.getLogger("pdserve.serve")

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
    retiring: bool = False  # asked to drain and leave: never restarted
    then: str | None = None  # the role of the node to start once this one has left (a flip)
    retired_at: float = 0.0

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
        for name, child in list(self.children.items()):
            proc = self.cluster.procs.get(name)
            if child.retiring:
                if proc is None or proc.poll() is not None:
                    self._left(child, proc)
            elif child.restart_at is not None:
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

    # -- the planner's changes (nodes of a P/D deployment) -------------------------------

    def start_node(self, role: str) -> str:
        """Start one more node of `role`; its name. OSError when it cannot be started."""
        name = self.cluster.add_node(role)
        self.children[name] = child = Child(name)
        proc = self.cluster.spawn(name)
        child.started(self.clock(), restart=False)
        log.info("%s started (pid %d) by the planner", name, proc.pid)
        return name

    def retire(self, name: str, then: str | None = None, at_once: bool = False) -> None:
        """Drain node `name` and let it leave (SIGTERM: it finishes what it holds; SIGKILL with
        at_once); with `then`, start a node of that role once it has left (a role flip)."""
        child = self.children[name]
        child.retiring, child.then, child.restart_at = True, then, None
        child.retired_at = self.clock()
        proc = self.cluster.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if at_once else signal.SIGTERM)
        log.info("%s %s by the planner", name, "stopped" if at_once else "draining")

    def _left(self, child: Child, proc: subprocess.Popen | None) -> None:
        status = "never started" if proc is None else exit_status(proc.returncode)
        log.info("%s left (%s)", child.name, status)
        del self.children[child.name]
        self.cluster.remove_node(child.name)
        if child.then is not None:
            self.start_node(child.then)

    def up(self, name: str) -> bool:
        proc = self.cluster.procs.get(name)
        return proc is not None and proc.poll() is None

    def run(
        self, stop: StopFlag, interval: float = 0.2, tick: Callable[[], None] | None = None
    ) -> None:
        """Supervise until stop is set or the router cannot be kept up; `tick` runs after
        every round (the planner: in this thread, so that only one changes the children)."""
        while not stop.wait(interval) and self.failed is None:
            self.poll()
            if tick is not None:
                tick()

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

    @property
    def registry(self) -> CollectorRegistry | None:
        """What its metrics endpoint serves (None: none is served); the planner's join it."""
        return None if self._metrics is None else self._metrics.registry

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

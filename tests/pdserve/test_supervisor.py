"""The supervisor's bookkeeping (backoff, restart limit, the router's limit) without processes."""

from __future__ import annotations

import signal

import pytest

from pdserve.local_cluster import LocalCluster
from pdserve.serve import Backoff, Child, Supervisor, exit_status


def test_backoff_doubles_up_to_its_maximum() -> None:
    b = Backoff(initial=1.0, maximum=30.0)
    assert [b.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError):
        Backoff(initial=0.0)


def test_a_child_that_stayed_up_starts_its_backoff_over() -> None:
    b = Backoff(initial=1.0, maximum=30.0, reset_after=60.0)
    child = Child("prefill0")
    child.started(0.0, restart=False)
    assert child.exited(1.0, b, max_restarts=10) == 1.0
    child.started(2.0, restart=True)
    assert child.exited(3.0, b, max_restarts=10) == 2.0  # a quick second exit: doubled
    child.started(5.0, restart=True)
    assert child.exited(500.0, b, max_restarts=10) == 1.0  # up for minutes: from the start
    assert child.restarts == 2 and child.restart_at == 501.0


def test_a_child_past_its_restart_limit_is_left_down() -> None:
    child = Child("decode0")
    child.started(0.0, restart=False)
    for i in range(2):
        assert child.exited(float(i), Backoff(), max_restarts=2) is not None
        child.started(float(i), restart=True)
    assert child.exited(9.0, Backoff(), max_restarts=2) is None
    assert child.given_up and child.restart_at is None


def test_exit_status_names_the_signal() -> None:
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(3) == "exit code 3"


class _Proc:
    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


class _FakeCluster(LocalCluster):
    """Children are fake processes; spawn records the restart."""

    def spawn(self, name: str):  # type: ignore[override]
        self.spawned.append(name)
        self.procs[name] = _Proc()
        return self.procs[name]


def _supervisor(max_restarts: int) -> tuple[Supervisor, _FakeCluster, list[float]]:
    cluster = _FakeCluster("m", 1, 1, port=1, control_port=2)
    cluster.spawned = []
    cluster.procs = {name: _Proc() for name in cluster.children()}
    now = [0.0]
    sup = Supervisor(cluster, max_restarts, Backoff(initial=1.0), clock=lambda: now[0])
    return sup, cluster, now


def test_the_supervisor_restarts_an_exited_node_after_its_backoff() -> None:
    sup, cluster, now = _supervisor(max_restarts=3)
    cluster.procs["prefill0"].returncode = -9
    sup.poll()
    assert cluster.spawned == [] and not sup.up("prefill0")
    now[0] = 0.5
    sup.poll()
    assert cluster.spawned == []  # still backing off
    now[0] = 1.0
    sup.poll()
    assert cluster.spawned == ["prefill0"] and sup.up("prefill0")
    assert sup.children["prefill0"].restarts == 1 and sup.failed is None


def test_a_router_past_its_limit_stops_the_deployment() -> None:
    sup, cluster, now = _supervisor(max_restarts=0)
    cluster.procs["decode0"].returncode = 1
    sup.poll()
    assert sup.failed is None  # a node left down: the rest keep serving
    cluster.procs["router"].returncode = 1
    sup.poll()
    assert sup.failed is not None and "router" in sup.failed

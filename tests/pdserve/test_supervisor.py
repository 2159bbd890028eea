"""The supervisor's bookkeeping (backoff, restart limit, the router's limit) and how
`pdserve serve` flags become the children's command lines, without processes."""

from __future__ import annotations

import signal

import pytest

from pdserve.local_cluster import LocalCluster, exit_status
from pdserve.serve import build_parser, cluster_from_args
from pdserve.supervisor import Backoff, Child, StopFlag, Supervisor


def test_backoff_doubles_up_to_its_maximum() -> None:
    b = Backoff(initial=1.0, maximum=30.0)
    assert [b.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError):
        Backoff(initial=0.0)
    with pytest.raises(ValueError):
        Backoff(initial=2.0, maximum=1.0)


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


def test_the_restart_limit_counts_exits_in_a_row_only() -> None:
    """A node that crashes now and then, after serving for a while, is always restarted."""
    b = Backoff(initial=1.0, reset_after=60.0)
    child = Child("prefill0")
    child.started(0.0, restart=False)
    for i in range(1, 6):
        assert child.exited(100.0 * i, b, max_restarts=1) == 1.0
        child.started(100.0 * i + 1, restart=True)
    assert child.restarts == 5 and not child.given_up
    assert child.exited(502.0, b, max_restarts=1) is None  # a second exit in a row: down
    assert child.given_up


def test_exit_status_names_the_signal() -> None:
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(3) == "exit code 3"


class _Proc:
    pid = 4242

    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


class _FakeCluster(LocalCluster):
    """Children are fake processes; spawn records the restart (or fails like a fork)."""

    fail_spawn = False

    def spawn(self, name: str):  # type: ignore[override]
        if self.fail_spawn:
            raise OSError(11, "Resource temporarily unavailable")
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


def test_spawn_failure_counts_as_an_exit_and_is_retried() -> None:
    sup, cluster, now = _supervisor(max_restarts=3)
    cluster.procs["decode0"].returncode = 1
    sup.poll()
    cluster.fail_spawn = True
    now[0] = 1.0
    sup.poll()  # fork failed: backed off again (doubled), not crashed, not given up
    child = sup.children["decode0"]
    assert child.restart_at == 3.0 and child.failures == 2 and not child.given_up
    cluster.fail_spawn = False
    now[0] = 3.0
    sup.poll()
    assert sup.up("decode0") and child.restarts == 1


def test_no_restart_once_stopping() -> None:
    sup, cluster, now = _supervisor(max_restarts=3)
    cluster.procs["prefill0"].returncode = -15
    sup.poll()
    sup.stopping = True
    now[0] = 100.0
    sup.poll()
    assert cluster.spawned == []


def test_start_gives_up_waiting_when_told_to_stop() -> None:
    sup, cluster, _ = _supervisor(max_restarts=3)
    cluster.ready = lambda: False  # type: ignore[method-assign]
    stop = StopFlag()
    stop.set()
    assert sup.start(timeout=60.0, stop=stop) is False
    assert sorted(cluster.spawned) == sorted(cluster.children())


def _cluster(argv: list[str]) -> LocalCluster:
    p = build_parser()
    return cluster_from_args(p, p.parse_args([*argv, "--port", "1", "--control-port", "2"]))


def test_serve_flags_reach_every_child() -> None:
    c = _cluster(
        ["--model", "M", "--num-prefill", "2", "--max-num-seqs", "8", "--no-prefix-caching"]
        + ["--served-model-name", "m", "--api-key", "k", "--router-flags", "--heartbeat-timeout 2"]
        + ["--drain-timeout", "5", "--kv-connector", "shm"]
    )
    children = c.children()
    assert sorted(children) == ["decode0", "prefill0", "prefill1", "router"]
    for name in ("prefill0", "prefill1", "decode0"):
        line = " ".join(children[name])
        assert "--model M " in line and f"--node-id {name}" in line, line
        assert "--max-num-seqs 8" in line and "--no-prefix-caching" in line, line
        assert "--drain-timeout 5.0" in line and "--kv-connector shm" in line, line
        assert "--max-num-batched-tokens" not in line  # defaults stay the nodes' own
    router = " ".join(children["router"])
    assert "--served-model-name m" in router and "--heartbeat-timeout 2" in router
    assert "k" not in children["router"] and c.api_key == "k"  # by environment, not in `ps`
    assert c.own_process_group  # the terminal's Ctrl-C goes to the supervisor only


def test_serve_topologies() -> None:
    assert sorted(_cluster(["M"]).children()) == ["decode0", "prefill0", "router"]
    assert sorted(_cluster(["--model", "M", "--colocated", "2"]).children()) == [
        "both0",
        "both1",
        "router",
    ]
    for bad in (["M", "--colocated", "1", "--num-prefill", "1"], ["M", "--num-decode", "0"], []):
        with pytest.raises(SystemExit):
            _cluster(bad)


def test_a_stop_signal_ends_the_supervising_wait() -> None:
    """The handler runs inside the main thread's wait and only flips a flag (no lock: see
    StopFlag); the wait then reports it."""
    stop = StopFlag()
    previous = signal.signal(signal.SIGALRM, lambda *_: stop.set())
    try:
        assert stop.wait(0.01) is False
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        assert stop.wait(0.2) is True and stop.is_set()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

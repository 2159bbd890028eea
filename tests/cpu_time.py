"""CPU seconds per test, for finding where the suite's time goes on a machine others load
(wall times there say more about the load than about the test): `-p tests.cpu_time`.

Each test's setup, call and teardown are charged the user + system seconds of this process and
of the child processes reaped meanwhile (nodes, routers, scripts; a node's ranks come with it),
and the session ends with the slowest PDSERVE_CPU_TOP (default 25) and the total. A child still
running when a phase ends (a module's cluster) is charged to the phase that reaps it. With
PDSERVE_CPU_LOG set, each phase's line is also appended to that file as it ends: a run stopped
by a timeout on a loaded machine still leaves what it measured.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest

from pdserve.testbed import zygote

_TIMES = pytest.StashKey[dict[tuple[str, str], float]]()


def cpu_seconds() -> float:
    """User + system seconds of this process and of its reaped children so far, with the
    children the test launcher forked for it (tests/conftest.py) once that launcher reaped
    them."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = zygote.children_cpu()
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + forked


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_TIMES] = {}


def _charge(item: pytest.Item, phase: str) -> Iterator[None]:
    start = cpu_seconds()
    try:
        return (yield)
    finally:  # a failing phase is charged too
        seconds = item.config.stash[_TIMES][(item.nodeid, phase)] = cpu_seconds() - start
        if log := os.environ.get("PDSERVE_CPU_LOG"):
            with open(log, "a") as out:
                out.write(_line(item.nodeid, phase, seconds) + "\n")


def _line(nodeid: str, phase: str, seconds: float) -> str:
    return f"{seconds:8.2f}s {phase:<8} {nodeid}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _charge(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _charge(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _charge(item, "teardown"))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    times = config.stash[_TIMES]
    if not times:  # pytest-xdist's controller: its workers run the tests, and keep their times
        return
    top = int(os.environ.get("PDSERVE_CPU_TOP", "25"))
    terminalreporter.write_sep("=", f"slowest {top} CPU times (user + sys, with children)")
    for (nodeid, phase), seconds in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        terminalreporter.write_line(_line(nodeid, phase, seconds))
    terminalreporter.write_line(f"{sum(times.values()):8.2f}s in all {len(times)} phases")

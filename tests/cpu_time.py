"""CPU seconds per test, for finding where the suite's time goes on a machine others load
(wall times there say more about the load than about the test): `-p tests.cpu_time`.

Each test's setup, call and teardown are charged the user + system seconds of this process and
of the child processes reaped meanwhile (nodes, routers, scripts; a node's ranks come with it),
beside the phase's wall seconds, and the session ends with the slowest PDSERVE_CPU_TOP (default
25), each folder's CPU and wall seconds, and the total. A child still running when a phase ends
(a module's cluster) is charged to the phase that reaps it. With PDSERVE_CPU_LOG set, each
phase's line is also appended to that file as it ends: a run stopped by a timeout on a loaded
machine still leaves what it measured.

A folder whose CPU seconds are a small share of its wall seconds on a quiet machine waits
(readiness polls, timeouts, a child's imports on another core) rather than computes: what a
second pytest worker (pytest-xdist) would overlap.
"""

from __future__ import annotations

import collections
import os
import resource
import time
from collections.abc import Iterator

import pytest

from pdserve.testbed import zygote

_TIMES = pytest.StashKey[dict[tuple[str, str], tuple[float, float]]]()  # (CPU s, wall s)


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
    start, began = cpu_seconds(), time.monotonic()
    try:
        return (yield)
    finally:  # a failing phase is charged too
        spent = (cpu_seconds() - start, time.monotonic() - began)
        item.config.stash[_TIMES][(item.nodeid, phase)] = spent
        if log := os.environ.get("PDSERVE_CPU_LOG"):
            with open(log, "a") as out:
                out.write(_line(item.nodeid, phase, *spent) + "\n")


def _line(name: str, phase: str, cpu: float, wall: float) -> str:
    return f"{cpu:8.2f}s {wall:8.2f}s {phase:<8} {name}"


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
    title = f"slowest {top} CPU times (user + sys, with children; then wall)"
    terminalreporter.write_sep("=", title)
    for (nodeid, phase), spent in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
        terminalreporter.write_line(_line(nodeid, phase, *spent))
    terminalreporter.write_sep("-", "per folder (CPU s, wall s, phases)")
    for folder, (cpu, wall, n) in sorted(per_folder(times).items()):
        terminalreporter.write_line(_line(folder, str(n), cpu, wall))
    cpu, wall = (sum(spent[i] for spent in times.values()) for i in (0, 1))
    terminalreporter.write_line(_line("in all", str(len(times)), cpu, wall))


def per_folder(times: dict[tuple[str, str], tuple[float, float]]) -> dict[str, tuple]:
    """folder (its modules' folder: tests/e2e, tests/common/node) -> (CPU s, wall s, phases)."""
    sums: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for (nodeid, _), (cpu, wall) in times.items():
        total = sums[nodeid.split("::", 1)[0].rpartition("/")[0] or "."]
        total[0], total[1], total[2] = total[0] + cpu, total[1] + wall, total[2] + 1
    return {folder: tuple(total) for folder, total in sums.items()}

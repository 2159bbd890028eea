"""tests/conftest.py: its order for pytest-xdist workers: each module one xdist group (a worker
runs it whole, so its module fixtures are built once), a module's own group kept, the slow
folders first and a module that reads a background run last, each otherwise in collection
order; a background run one worker begins and another reads; and its stop of the launcher and
background runs at the session's end, which never raises."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

pytest_plugins = ["pytester"]

MODULES = {
    "tests/common/test_a.py": "def test_a1(): pass\ndef test_a2(): pass\n",
    "tests/e2e/test_b.py": "def test_b1(): pass\n",
    "tests/router/test_c.py": (
        "import pytest\n"
        "@pytest.mark.xdist_group('shared')\n"
        "def test_c1(): pass\n"
        "def test_c2(): pass\n"
    ),
    "tests/bench/test_d.py": (
        "import pytest\n"
        "def start(out): pass\n"
        "def test_d1(): pass\n"
        "@pytest.mark.background.with_args(start)\n"
        "def test_d2(): pass\n"
    ),
}


def test_modules_are_groups_slow_folders_first_background_readers_last(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nmarkers =\n  xdist_group\n  background\n")
    for path, source in MODULES.items():
        pytester.path.joinpath(path).parent.mkdir(parents=True, exist_ok=True)
        pytester.path.joinpath(path).write_text(source)
    items, _ = pytester.inline_genitems("tests")
    conftest._order_for_workers(items)
    assert [item.name for item in items] == [
        "test_b1",  # the slow folders first, in collection order
        "test_a1",
        "test_a2",
        "test_c1",
        "test_c2",
        "test_d1",  # its module reads a background run (begun at collection): last, whole
        "test_d2",
    ]
    groups = {item.name: item.get_closest_marker("xdist_group").args[0] for item in items}
    assert groups == {
        "test_a1": "tests/common/test_a.py",
        "test_a2": "tests/common/test_a.py",
        "test_b1": "tests/e2e/test_b.py",
        "test_c1": "shared",  # its own mark wins
        "test_c2": "tests/router/test_c.py",
        "test_d1": "tests/bench/test_d.py",
        "test_d2": "tests/bench/test_d.py",
    }


class _NeverExits:
    """A child whose every wait times out (a killed launcher still freeing its memory)."""

    pid = 4242

    def __init__(self) -> None:
        self.signals: list[str] = []

    def terminate(self) -> None:
        self.signals.append("TERM")

    def kill(self) -> None:
        self.signals.append("KILL")

    def wait(self, timeout: float) -> int:
        raise subprocess.TimeoutExpired("child", timeout)


def test_a_child_slow_to_exit_is_killed_and_warned_about_not_raised() -> None:
    """The session's end stops the launcher and background runs with _stop: a raise there
    ended a run without its summary."""
    child = _NeverExits()
    with pytest.warns(UserWarning, match="pid 4242 not gone"):
        conftest._stop(child, 0.01)  # type: ignore[arg-type]
    assert child.signals == ["TERM", "KILL"]


def exits_with(code: int) -> Callable[[Path], subprocess.Popen]:
    def start(out: Path) -> subprocess.Popen:
        (out / "log").write_text("the run's output")
        return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])

    return start


def test_a_background_run_one_worker_begins_another_reads() -> None:
    """Under xdist gw0 starts the run at collection; gw1, given its readers, finds the same
    folder and waits there for the run's exit status."""
    start, run_id = exits_with(3), f"test-{id(object())}"
    worker = {"testrunuid": run_id}
    gw1 = SimpleNamespace(workerinput={**worker, "workerid": "gw1"})
    gw0 = SimpleNamespace(workerinput={**worker, "workerid": "gw0"})
    read, read_out = conftest._begin(start, gw1)  # type: ignore[arg-type]
    began, out = conftest._begin(start, gw0)  # type: ignore[arg-type]
    assert read_out == out and (out / "log").read_text() == "the run's output"
    assert read.returncode is None
    assert read.wait(60) == 3 and read.returncode == 3
    assert began.wait(60) == 3 and began.returncode == 3


def test_a_read_run_that_never_ends_times_out(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        conftest._Read(tmp_path).wait(0.01)

"""tests/cpu_time.py's log (PDSERVE_CPU_LOG): every phase of every test, failing ones too, one
line each as it ends, the lines the summary prints."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_each_phase_is_logged_as_it_ends(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = pytester.path / "cpu.log"
    monkeypatch.setenv("PDSERVE_CPU_LOG", str(log))
    pytester.makepyfile(test_two="def test_ok(): pass\ndef test_fails(): assert False\n")
    result = pytester.runpytest_inprocess("-p", "tests.cpu_time", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    lines = log.read_text().splitlines()
    phases = [line.split()[1:] for line in lines]
    assert phases == [
        [phase, f"test_two.py::{name}"]
        for name in ("test_ok", "test_fails")
        for phase in ("setup", "call", "teardown")
    ]
    assert all(float(line.split()[0].rstrip("s")) >= 0 for line in lines)
    summary = result.stdout.str()
    assert all(line in summary for line in lines)  # the summary's own lines

"""tests/cpu_time.py's log (PDSERVE_CPU_LOG): every phase of every test, failing ones too, one
line each as it ends (CPU and wall seconds), the lines the summary prints, and the folders'
sums."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_each_phase_is_logged_as_it_ends(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = pytester.path / "cpu.log"
    monkeypatch.setenv("PDSERVE_CPU_LOG", str(log))
    code = "import time\ndef test_ok(): time.sleep(0.3)\ndef test_fails(): assert False\n"
    pytester.mkpydir("sub").joinpath("test_two.py").write_text(code)
    result = pytester.runpytest_inprocess("-p", "tests.cpu_time", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    lines = log.read_text().splitlines()
    phases = [line.split()[2:] for line in lines]
    assert phases == [
        [phase, f"sub/test_two.py::{name}"]
        for name in ("test_ok", "test_fails")
        for phase in ("setup", "call", "teardown")
    ]
    cpu, wall = ([float(line.split()[i].rstrip("s")) for line in lines] for i in (0, 1))
    assert all(s >= 0 for s in cpu + wall)
    assert wall[1] >= 0.3  # test_ok's call sleeps: wall time, not CPU time
    summary = result.stdout.str()
    assert all(line in summary for line in lines)  # the summary's own lines
    folder = [line.split() for line in summary.splitlines() if line.endswith(" sub")]
    assert len(folder) == 1 and folder[0][2] == "6"  # one folder line: its six phases
    assert float(folder[0][1].rstrip("s")) == pytest.approx(sum(wall), abs=0.05)

"""scripts/test.sh refuses a worker count that is not one: before it touches the venv or pytest."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.bench.helpers import REPO


@pytest.mark.parametrize("workers", ["abc", "0", "02", "-1", "2x"])
def test_a_bad_worker_count_is_refused_with_its_value(workers: str) -> None:
    env = {**os.environ, "PDSERVE_TEST_WORKERS": workers}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), "--version"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"number of workers, 1 or more (1: no xdist), not '{workers}'" in proc.stderr

"""Each launch script starts its role alone: router first (unhealthy with no nodes), then a
prefill node and a decode node that register with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[2]


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def wait_for(port: int, status: int, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a launch script exited"
        if health(port) == status:
            return
        time.sleep(0.3)
    raise AssertionError(f"/health never answered {status}")


def test_each_launch_script_starts_its_role(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    port, control = free_port(), free_port()
    env = dict(os.environ, PDSERVE_VENV=sys.prefix)
    procs: list[subprocess.Popen] = []

    def launch(script: str, *args: str) -> None:
        procs.append(
            subprocess.Popen(
                ["bash", str(ROOT / "scripts" / script), "--model", model, *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    try:
        launch("launch_router.sh", "--port", str(port), "--control-port", str(control))
        wait_for(port, 503, procs, 180)  # up, but no node to serve from yet
        router = f"127.0.0.1:{control}"
        launch("launch_prefill.sh", "--router", router)
        launch("launch_decode.sh", "--router", router)
        wait_for(port, 200, procs, 180)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    assert all(p.returncode is not None for p in procs)

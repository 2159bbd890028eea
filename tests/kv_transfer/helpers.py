"""Shared by the tests and the sender child process: deterministic caches, a child harness."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVReceiver, TransferResult
from pdserve.kv_transfer.nixl_agent import nixl_installed
from tests.conftest import module_command

# A nixl test skips only where no NIXL package is installed; an installed one that fails to
# load fails the test (load_nixl names the import error).
needs_nixl = pytest.mark.skipif(
    not nixl_installed(), reason="nixl extra not installed: pip install 'pdserve[nixl]'"
)

REPO = Path(__file__).resolve().parents[2]


def make_caches(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Random layer caches, the same in every process for the same arguments."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layout.num_layers)]


class Pump:
    """Polls receivers and keeps their results by xfer id."""

    def __init__(self, *receivers: KVReceiver) -> None:
        self.receivers = receivers
        self.results: dict[str, TransferResult] = {}

    def once(self, timeout: float = 0.005) -> None:
        for receiver in self.receivers:
            for result in receiver.poll(timeout):
                assert result.xfer_id not in self.results, f"{result.xfer_id} finished twice"
                self.results[result.xfer_id] = result

    def until(self, check: Any, timeout: float = 15.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.once()

    def wait_results(self, *xfer_ids: str, timeout: float = 15.0) -> list[TransferResult]:
        self.until(lambda: all(x in self.results for x in xfer_ids), timeout, f"{xfer_ids}")
        return [self.results[x] for x in xfer_ids]


class SenderProcess:
    """A child process running tests/kv_transfer/sender_proc.py, driven by JSON lines.

    While a command runs, `call` keeps polling the given pump: the receivers live in the test
    process and only make progress (handshakes included) when polled. A command's wait starts
    once the child has said it is ready: its imports (torch) took 28 to 42 s on a loaded machine,
    more than a command's 20 s, and failed the first command of a module when counted in it.
    """

    START_TIMEOUT = 300.0

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            module_command("tests.kv_transfer.sender_proc"),
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self._await(None, self.START_TIMEOUT, "its ready line")
            assert ready == {"ok": True, "ready": True}, ready
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))

    def call(self, pump: Pump | None, wait_s: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """Send cmd and wait up to wait_s for its reply (named apart from the commands' own
        `timeout`, which a caller's keyword went to instead: the sender's connect was given
        the child's default while this wait was cut to 5 s, and failed under load)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._await(pump, wait_s, cmd["op"])

    def _await(self, pump: Pump | None, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._replies.get_nowait()
            except queue.Empty:
                pass
            assert self.proc.poll() is None, f"sender process died ({self.proc.returncode})"
            assert time.monotonic() < deadline, f"sender process did not answer {what}"
            if pump is not None:
                pump.once()
            else:
                time.sleep(0.005)

    def ok(self, pump: Pump | None, **cmd: Any) -> dict[str, Any]:
        reply = self.call(pump, **cmd)
        assert reply["ok"], reply
        return reply

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(None, wait_s=5.0, op="exit")
            self.proc.wait(timeout=5.0)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=5.0)
        finally:
            self._reader.join(timeout=5.0)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()

"""An OTLP/HTTP trace endpoint on loopback, for the tests and `pdserve bench tracing`: what a
collector would be to the processes that export spans.

`OtlpReceiver` answers every export 200 and hands its body (gunzipped) to a `take` hook: the
tests decode the spans and keep them, the benchmark counts the bytes and drops them. Run as a
module (`python -m pdserve.common.tracing_receiver`) it is a dropping receiver in a process of
its own: it prints `{"url": ...}`, serves until its stdin closes, then prints
`{"batches": n, "bytes": n}` (`ReceiverProcess` drives it): the benchmark's load generator
then shares no interpreter with it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

PATH = "/v1/traces"


class OtlpReceiver:
    """OTLP/HTTP exports to `url`, each body (gunzipped when the exporter compressed it)
    handed to `take` on the server's thread."""

    def __init__(self, take: Callable[[bytes], None]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                take(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}{PATH}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class ReceiverProcess:
    """A dropping OtlpReceiver in a child process; `close` ends it and returns what it got."""

    def __init__(self, timeout: float = 30.0) -> None:
        self._timeout = timeout
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__],  # this module, imported by its full name
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = _read_line(self._proc, timeout)
        self.url: str = json.loads(line)["url"]

    def close(self) -> dict[str, int]:
        """The batches and bytes received; the child is gone after it."""
        try:
            out, _ = self._proc.communicate("", timeout=self._timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(self._timeout)
            raise
        return json.loads(out.strip().splitlines()[-1])


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's first line of stdout, or RuntimeError past `timeout` s (it may hang)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0]:
        proc.kill()
        proc.wait(timeout)
        raise RuntimeError(f"the OTLP receiver process did not start within {timeout} s")
    return got[0]


def main() -> None:
    counts = {"batches": 0, "bytes": 0}
    lock = threading.Lock()

    def drop(body: bytes) -> None:
        with lock:
            counts["batches"] += 1
            counts["bytes"] += len(body)

    with OtlpReceiver(drop) as receiver:
        print(json.dumps({"url": receiver.url}), flush=True)
        sys.stdin.read()  # until the parent closes it
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()

"""Child process for the connector tests: builds caches and senders, obeys JSON lines on stdin.

One reply line per command: {"ok": true, ...} or {"ok": false, "error": type, "message": str}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pdserve.common.wire.payloads import FirstToken, TokenLogprobs
from pdserve.kv_transfer import KVLayout, KVSender, create_sender
from pdserve.testbed.kvfaults import FaultPlan, PlannedFaults
from tests.kv_transfer.helpers import make_caches


class Child:
    def __init__(self) -> None:
        self.caches: dict[str, list[Any]] = {}
        self.senders: dict[str, KVSender] = {}

    def cache(
        self,
        name: str,
        layout: dict[str, Any],
        num_blocks: int,
        seed: int,
        heads: list[int] | None = None,
    ) -> None:
        """Random caches; with `heads` [first, end), only those KV heads of them (the share a
        tensor-parallel rank holds)."""
        caches = make_caches(KVLayout.from_dict(layout), num_blocks, seed)
        if heads is not None:
            caches = [c[:, :, :, heads[0] : heads[1]].contiguous() for c in caches]
        self.caches[name] = caches

    def sender(
        self,
        name: str,
        connector: str,
        layout: dict[str, Any],
        endpoint: str,
        timeout: float = 10.0,
        corrupt: str = "",
        opts: dict[str, Any] | None = None,
    ) -> None:
        sender = create_sender(
            connector, KVLayout.from_dict(layout), send_timeout=10.0, **(opts or {})
        )
        if corrupt:  # these transfer ids ("*": all) are corrupted after their checksum
            sender.faults = PlannedFaults(FaultPlan(targets=frozenset(corrupt.split(","))))
        sender.connect(endpoint, timeout)
        self.senders[name] = sender

    def send(
        self,
        sender: str,
        cache: str,
        xfer: str,
        layers: list[int],
        src: list[int],
        dst: list[int],
        heads: list[int] | None = None,
    ) -> None:
        """Send pages; with `heads` [first, end), only those heads of the cache."""
        part = None if heads is None else range(*heads)
        for layer in layers:
            self.senders[sender].send_layer(xfer, layer, src, dst, self.caches[cache][layer], part)

    def done(self, sender: str, xfer: str, token: int, logprob: float | None) -> None:
        """End a transfer with first token `token` (and its logprob, the only one of its top)."""
        lps = None if logprob is None else TokenLogprobs(token, logprob, ((token, logprob),), 1)
        self.senders[sender].send_done(xfer, FirstToken(token, lps))

    def flush(self, sender: str) -> None:
        self.senders[sender].flush(10.0)

    def poll(self, sender: str, cancelled: list[str] | None = None, timeout: float = 10.0) -> None:
        """Let the sender take its receiver's messages; with `cancelled`, until it has taken
        the cancel of each of these (and answered it), however late the cancels arrive: a
        prefill node's loop polls every turn, a single poll may come before they do."""
        kv = self.senders[sender]
        kv.poll()
        deadline = time.monotonic() + timeout
        while not all(x in kv._cancelled for x in cancelled or ()):  # type: ignore[attr-defined]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{sender} never took the cancel of {cancelled}")
            kv._sock.poll(10)  # type: ignore[attr-defined]  # until the receiver says more
            kv.poll()

    def close(self, sender: str) -> None:
        self.senders.pop(sender).close()


def main() -> None:
    child = Child()
    print(json.dumps({"ok": True, "ready": True}), flush=True)  # imports done (SenderProcess)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            getattr(child, op)(**cmd)
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)
    for sender in child.senders.values():
        sender.close()
    print(json.dumps({"ok": True}), flush=True)


if __name__ == "__main__":
    main()

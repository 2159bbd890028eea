"""Fake colocated nodes in one process: they register with routers and answer every prefill at
once with fixed tokens, so nothing but the routers limits a cluster (`pdserve bench router`).

    python -m pdserve.testbed.fake_nodes SPEC_JSON

SPEC holds routers (control addresses), nodes, token_ids (cycled into each answer),
tokens_per_message, num_blocks, max_model_len and counts_file (what they did, written at exit).
SIGUSR1 sends each answer in one message, SIGUSR2 back to tokens_per_message; SIGTERM stops.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from pdserve.common.wire import messages as m

HEARTBEAT_S = 0.5
COUNTS = ("prefills", "tokens", "messages", "skipped", "send_timeouts", "refused")


def command(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "pdserve.testbed.fake_nodes", json.dumps(spec)]


def tokens_packer() -> Callable[[str, list[int], str], bytes]:
    """A packer of `tokens` frames byte-identical to messages.encode(Tokens(...)), about five
    times cheaper, so the load side stays light; the protocol's own encoder when the message
    has grown a field (checked against encode)."""
    packer = msgpack.Packer(use_bin_type=True)
    fields = {"logprobs": (), "cached_tokens": 0, "prompt_logprobs": (), "type": "tokens"}

    def fast(request_id: str, token_ids: list[int], finish_reason: str) -> bytes:
        frame = {"request_id": request_id, "token_ids": token_ids, "finish_reason": finish_reason}
        return packer.pack({**frame, **fields, "version": m.PROTOCOL_VERSION})

    def exact(request_id: str, token_ids: list[int], finish_reason: str) -> bytes:
        return m.encode(m.Tokens(request_id, tuple(token_ids), finish_reason=finish_reason))

    same = fast("r-1", [5, 6], "length") == exact("r-1", [5, 6], "length")
    return fast if same else exact


class FakeNodes:
    """The nodes, each on a DEALER per router (identity: its node id)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pack = tokens_packer()
        self.streamed = self.per_message = max(1, int(spec["tokens_per_message"]))
        self.stop = False
        self.counts = dict.fromkeys(COUNTS, 0)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.owners: dict[zmq.Socket, tuple[str, str]] = {}  # socket -> (node id, incarnation)
        for i in range(int(spec["nodes"])):
            for addr in spec["routers"]:
                self._connect(f"fake-{i}", secrets.token_hex(8), addr)

    def _connect(self, node_id: str, incarnation: str, addr: str) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, node_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDTIMEO, 5000)  # a router that stops reading: drop, go on
        sock.connect(f"tcp://{addr}")
        self.poller.register(sock, zmq.POLLIN)
        self.owners[sock] = (node_id, incarnation)

    def on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGUSR1:
            self.per_message = 1 << 30
        elif signum == signal.SIGUSR2:
            self.per_message = self.streamed
        else:
            self.stop = True

    def send(self, sock: zmq.Socket, frame: bytes) -> None:
        try:
            sock.send(frame)
        except zmq.Again:
            self.counts["send_timeouts"] += 1

    def register(self, sock: zmq.Socket) -> None:
        node_id, incarnation = self.owners[sock]
        blocks, max_len = int(self.spec["num_blocks"]), int(self.spec["max_model_len"])
        msg = m.RegisterNode(
            node_id=node_id, role="both", kv_endpoints=(), kv_connector="", layout_digest="",
            num_blocks=blocks, block_size=16, max_model_len=max_len, incarnation=incarnation,
        )  # fmt: skip
        self.send(sock, m.encode(msg))

    def answer(self, sock: zmq.Socket, msg: m.Prefill) -> None:
        """max_tokens of the word ids, cycled, `per_message` to a `tokens` message."""
        words: list[int] = self.spec["token_ids"]
        ids = [words[i % len(words)] for i in range(int(msg.sampling.max_tokens or 16))]
        step = self.per_message  # a signal may change it meanwhile
        self.counts["prefills"] += 1
        self.counts["tokens"] += len(ids)
        for start in range(0, len(ids), step):
            last = start + step >= len(ids)
            self.send(sock, self.pack(msg.request_id, ids[start : start + step], "length" * last))
            self.counts["messages"] += 1

    def handle(self, sock: zmq.Socket, frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except m.ProtocolError:  # a type added later (an acknowledgement, say)
            self.counts["skipped"] += 1
            return
        if isinstance(msg, m.Prefill):
            self.answer(sock, msg)
        elif isinstance(msg, m.CheckIntegrity):
            blocks = int(self.spec["num_blocks"])
            report = m.IntegrityReport(msg.nonce, True, num_blocks=blocks, free_blocks=blocks)
            self.send(sock, m.encode(report))
        elif isinstance(msg, m.Reregister):
            self.register(sock)
        elif isinstance(msg, m.Registered) and not msg.accepted:
            self.counts["refused"] += 1  # the router turned the node away: say why
            print(f"{self.owners[sock][0]} refused: {msg.reason}", file=sys.stderr, flush=True)
        # lease, abort, sync_prefixes, anything else: nothing to do

    def run(self) -> dict[str, int]:
        """Until SIGTERM: heartbeats, and every frame each socket has waiting."""
        for sock in self.owners:
            self.register(sock)
        next_beat = time.monotonic()
        while not self.stop:
            if time.monotonic() >= next_beat:
                for sock, (node_id, _) in self.owners.items():
                    beat = m.Heartbeat(node_id, self.spec["num_blocks"], 0, 0, 0)
                    self.send(sock, m.encode(beat))
                next_beat = time.monotonic() + HEARTBEAT_S
            try:
                ready = dict(self.poller.poll(timeout=int(HEARTBEAT_S * 1000 / 2)))
            except zmq.ZMQError:  # interrupted by the signal
                continue
            for sock in ready:
                for _ in range(1000):  # then let the other sockets and the heartbeat have a turn
                    try:
                        self.handle(sock, sock.recv(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
        for sock in self.owners:
            sock.close(linger=0)
        self.ctx.term()
        return self.counts


def main(spec: dict[str, Any]) -> None:
    """The fake nodes until SIGTERM; their counts go to spec["counts_file"]."""
    nodes = FakeNodes(spec)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, nodes.on_signal)
    Path(spec["counts_file"]).write_text(json.dumps(nodes.run()))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

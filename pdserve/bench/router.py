"""Router ceiling: how much one router can proxy, and the gain from a second.

    pdserve bench router                        # docs/bench + docs/benchmarks.md
    pdserve bench router --quick --out DIR      # seconds; what the tests run
    python scripts/bench_router.py ...          # the same, as the docs cite it

Nodes that answer at once take the model out of the measurement, so what limits the cluster
is the router itself. One process holds `--nodes` fake colocated nodes; each speaks the node
side of the control protocol (docs/protocol.md) to every router over a DEALER socket whose
identity is its node id: `register_node`, a `heartbeat` every 0.5 s, and for every `prefill`
`max_tokens` token ids in `tokens` messages (`--tokens-per-message` ids each: 1 streams like
a real decode node), the last with finish_reason "length", to the router that sent it. The
ids are words of the tokenizer, cycled, so the text a client gets back is known exactly.

Two real routers (`python -m pdserve.router MODEL`, on free ports) run throughout; every fake
node registers with both, as a real node given `--router` twice does. Routers share no state,
so a second one is only a second address for the client to spread requests over. For each
CPU plan (`--pins`), each concurrency N and 1 then 2 routers, client processes keep N
streaming `/v1/completions` requests in flight (keep-alive connections spread round-robin
over the active routers), warm up, then count for `--duration` seconds: requests and output
tokens completed per second, TTFT and latency percentiles, errors, and every reply checked
against the text the fake nodes sent (`corrupt` counts the ones that differ).

CPU plans: `split` pins the routers to the last cores and the load (client and fake nodes) to
the rest, a core per router where the host has enough, so a router never waits for the
client; with fewer than 3 cores both routers share one core. `shared` pins nothing. Each row
records the plan and the CPU each process used in the window (from /proc), so a row can be
read as router CPU per request, whoever ran out of CPU first. Each row is the best of
`--repeats` tries, taken in whole passes so that a burst of other work on the host hits one
try of a row, and each try first waits (up to `--quiet-wait` s) for the host to go idle. After
the rows, `--cost-split` runs one router with each request's tokens streamed and with all of
them in one message: its fixed CPU per request, and what each streamed token adds.

The client is an asyncio Protocol (HTTP/1.1 keep-alive; chunked SSE parsed by hand as bytes
arrive, one json.loads per chunk, no coroutine step per chunk): several times cheaper per token
than the router, so the router runs out of CPU first wherever it has as much as the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench import report as report_io
from pdserve.bench.report import (
    Outputs,
    add_from_json_flag,
    add_output_flags,
    cached_model,
    command_line,
    markdown_table,
    outputs_from_args,
    pyplot,
    save_figure,
    sigterm_raises,
)
from pdserve.common.node.cli import parser

HOST = "127.0.0.1"
MODEL_NAME = "router-bench"
MODEL_SPEC: dict[str, Any] = {}  # make_tiny_model's defaults: only its tokenizer matters here
PINS = ("split", "shared")
ROUTERS = (1, 2)
HEARTBEAT_S = 0.5
REQUEST_TIMEOUT_S = 30.0
START_TIMEOUT_S = 90.0
CHILD_START_S = 0.5  # the client processes start (~0.3 s) before their warm-up counts
DRAIN_TIMEOUT_S = 60.0
QUIET_CORES = 0.25  # busy CPU of a host taken as idle (our idle routers use ~0.01)
PROMPTS = (
    "The quick brown fox jumps over the lazy dog near the river bank",
    "Write a short story about a cat who finds a map in an old house",
    "Explain why the sky is blue in one sentence for a child",
    "List three things a farmer does in the morning before sunrise",
)


@dataclass(frozen=True, slots=True)
class Sizes:
    concurrency: tuple[int, ...]
    max_tokens: int
    warmup_s: float
    duration_s: float
    pins: tuple[str, ...]
    repeats: int


FULL = Sizes((8, 16, 32, 64, 128), 32, 1.0, 5.0, PINS, 2)
QUICK = Sizes((4, 16), 16, 0.5, 2.0, ("split",), 1)


# -- the fake nodes (a child process) -------------------------------------------------------------


def _tokens_frame_fast(version: int) -> Any:
    """A packer of `tokens` frames byte-identical to messages.encode(Tokens(...)), about five
    times cheaper (checked against encode before use), so the load side stays light."""
    import msgpack

    packer = msgpack.Packer(use_bin_type=True)

    def pack(request_id: str, token_ids: list[int], finish_reason: str) -> bytes:
        return packer.pack(
            {
                "request_id": request_id,
                "token_ids": token_ids,
                "logprobs": (),
                "finish_reason": finish_reason,
                "cached_tokens": 0,
                "prompt_logprobs": (),
                "type": "tokens",
                "version": version,
            }
        )

    return pack


def run_fake_nodes(spec: dict[str, Any]) -> int:
    """Fake colocated nodes answering every prefill at once, until SIGTERM; prints counts."""
    import zmq

    from pdserve.common.wire import messages as m

    fast = _tokens_frame_fast(m.PROTOCOL_VERSION)
    sample = m.Tokens("r-1", (5, 6), finish_reason="length")
    if fast("r-1", [5, 6], "length") == m.encode(sample):
        pack = fast
    else:  # the message grew a field: fall back to the protocol's own encoder

        def pack(request_id: str, token_ids: list[int], finish_reason: str) -> bytes:
            return m.encode(m.Tokens(request_id, tuple(token_ids), finish_reason=finish_reason))

    token_ids: list[int] = spec["token_ids"]
    streamed = max(1, int(spec["tokens_per_message"]))
    per_message = streamed
    num_blocks, max_len = int(spec["num_blocks"]), int(spec["max_model_len"])
    stop = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop, per_message
        if signum == signal.SIGUSR1:  # all of a request's tokens in one message
            per_message = 1 << 30
        elif signum == signal.SIGUSR2:  # back to streaming
            per_message = streamed
        else:
            stop = True

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, on_signal)
    ctx = zmq.Context()
    poller = zmq.Poller()
    owners: dict[zmq.Socket, tuple[str, str]] = {}  # socket -> (node id, incarnation)
    kinds = ("prefills", "tokens", "messages", "skipped", "send_timeouts", "refused")
    counts = dict.fromkeys(kinds, 0)
    for i in range(int(spec["nodes"])):
        node_id, incarnation = f"fake-{i}", secrets.token_hex(8)
        for addr in spec["routers"]:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, node_id.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SNDTIMEO, 5000)  # a router that stops reading: drop, go on
            sock.connect(f"tcp://{addr}")
            poller.register(sock, zmq.POLLIN)
            owners[sock] = (node_id, incarnation)

    def send(sock: zmq.Socket, frame: bytes) -> None:
        try:
            sock.send(frame)
        except zmq.Again:
            counts["send_timeouts"] += 1

    def register(sock: zmq.Socket) -> None:
        node_id, incarnation = owners[sock]
        msg = m.RegisterNode(
            node_id=node_id,
            role="both",
            kv_endpoint="",
            kv_connector="",
            layout_digest="",
            num_blocks=num_blocks,
            block_size=16,
            max_model_len=max_len,
            incarnation=incarnation,
        )
        send(sock, m.encode(msg))

    def answer(sock: zmq.Socket, msg: m.Prefill) -> None:
        n = int(msg.sampling.get("max_tokens") or 16)
        ids = [token_ids[i % len(token_ids)] for i in range(n)]
        step = per_message  # a signal may change it meanwhile
        counts["prefills"] += 1
        counts["tokens"] += n
        for start in range(0, n, step):
            last = start + step >= n
            send(sock, pack(msg.request_id, ids[start : start + step], "length" * last))
            counts["messages"] += 1

    for sock in owners:
        register(sock)
    next_beat = time.monotonic()
    while not stop:
        now = time.monotonic()
        if now >= next_beat:
            for sock, (node_id, _) in owners.items():
                beat = m.Heartbeat(node_id, num_blocks, 0, 0, 0)
                send(sock, m.encode(beat))
            next_beat = now + HEARTBEAT_S
        try:
            ready = dict(poller.poll(timeout=int(HEARTBEAT_S * 1000 / 2)))
        except zmq.ZMQError:  # interrupted by the signal
            continue
        for sock in ready:
            for _ in range(1000):  # then let the other sockets and the heartbeat have a turn
                try:
                    frame = sock.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = m.decode(frame)
                except m.ProtocolError:  # a type added later (an acknowledgement, say)
                    counts["skipped"] += 1
                    continue
                if isinstance(msg, m.Prefill):
                    answer(sock, msg)
                elif isinstance(msg, m.CheckIntegrity):
                    report = m.IntegrityReport(
                        msg.nonce, True, num_blocks=num_blocks, free_blocks=num_blocks
                    )
                    send(sock, m.encode(report))
                elif isinstance(msg, m.Reregister):
                    register(sock)
                elif type(msg).__name__ == "Registered" and not getattr(msg, "accepted", True):
                    counts["refused"] += 1  # the router turned the node away: say why
                    reason = getattr(msg, "reason", "")
                    print(f"{owners[sock][0]} refused: {reason}", file=sys.stderr, flush=True)
                # lease, abort, sync_prefixes, anything else: nothing to do
    for sock in owners:
        sock.close(linger=0)
    ctx.term()
    print(json.dumps(counts), flush=True)
    return 0


# -- the load (client child processes) ------------------------------------------------------------


class ClientStats:
    """What one client process saw: requests that ended inside the window, and failures."""

    def __init__(self, window: tuple[float, float]) -> None:
        self.window = window
        self.requests = 0
        self.tokens = 0
        self.chunks = 0
        self.corrupt = 0
        self.errors = 0
        self.error_samples: list[str] = []
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.total = 0  # every request answered, the warm-up and drain included

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]

    def error(self, t: float, why: str) -> None:
        if not self.in_window(t):
            return
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(why[:300])

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "chunks": self.chunks,
            "corrupt": self.corrupt,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "ttft": self.ttft,
            "latency": self.latency,
            "total": self.total,
        }


@dataclass(slots=True)
class Reply:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    tokens: int | None = None
    chunks: int = 0
    t_first: float | None = None
    keep_alive: bool = True
    done: bool = False  # [DONE] seen
    error: str = ""


def http_request(port: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


class SSEConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection; a response (chunked SSE, or a body of known length)
    is parsed as its bytes arrive, in data_received: no coroutine step per chunk, so the
    client costs far less per token than the router it loads."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()
        self._sse = b""
        self._parts: list[str] = []
        self._reply = Reply()
        self._waiter: asyncio.Future[Reply] | None = None
        self._state = "idle"
        self._need = 0
        self._body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def request(self, data: bytes) -> asyncio.Future[Reply]:
        assert self.transport is not None and self._state == "idle"
        self._waiter = asyncio.get_running_loop().create_future()
        self._reply, self._parts, self._sse, self._body = Reply(), [], b"", b""
        self._state = "head"
        self.transport.write(data)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except (ValueError, KeyError, TypeError) as exc:  # garbage: fail the request
            self._state = "idle"
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(ValueError(f"bad response: {exc!r}"))
            if self.transport is not None:
                self.transport.close()

    def _parse(self) -> None:
        buf = self._buf
        while True:
            state = self._state
            if state == "head":
                cut = buf.find(b"\r\n\r\n")
                if cut < 0:
                    return
                head = bytes(buf[: cut + 4]).lower()
                del buf[: cut + 4]
                self._reply.status = int(head[9:12])
                self._reply.keep_alive = b"connection: close" not in head
                if b"transfer-encoding: chunked" in head:
                    self._state = "size"
                else:
                    at = head.find(b"content-length:")
                    if at < 0:
                        raise ValueError("neither chunked nor Content-Length")
                    self._need = int(head[at + 15 : head.index(b"\r\n", at)])
                    self._state = "body"
            elif state == "size":
                cut = buf.find(b"\r\n")
                if cut < 0:
                    return
                size = int(bytes(buf[:cut]).split(b";", 1)[0], 16)
                del buf[: cut + 2]
                self._need, self._state = size + 2, ("data" if size else "trailer")
            elif state == "data":
                if len(buf) < self._need:
                    return
                self._piece(bytes(buf[: self._need - 2]))
                del buf[: self._need]
                self._state = "size"
            elif state == "trailer":
                cut = buf.find(b"\r\n")
                if cut < 0:
                    return
                del buf[: cut + 2]
                self._finish()
            elif state == "body":
                if len(buf) < self._need:
                    return
                self._piece(bytes(buf[: self._need]))
                del buf[: self._need]
                self._finish()
            else:  # idle: bytes nobody asked for
                buf.clear()
                return

    def _piece(self, data: bytes) -> None:
        reply = self._reply
        if reply.status != 200:
            self._body += data
            return
        self._sse += data
        while (cut := self._sse.find(b"\n\n")) >= 0:
            event, self._sse = self._sse[:cut], self._sse[cut + 2 :]
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                reply.done = True
                continue
            obj = json.loads(payload)
            if "error" in obj:
                reply.error = json.dumps(obj["error"])[:300]
                continue
            reply.chunks += 1
            for choice in obj.get("choices") or ():
                if choice.get("text"):
                    if reply.t_first is None:
                        reply.t_first = time.monotonic()
                    self._parts.append(choice["text"])
                if choice.get("finish_reason"):
                    reply.finish_reason = choice["finish_reason"]
            usage = obj.get("usage")
            if usage:
                reply.tokens = usage.get("completion_tokens")

    def _finish(self) -> None:
        reply = self._reply
        reply.text = "".join(self._parts)
        if reply.status != 200:
            reply.error = f"HTTP {reply.status}: {self._body[:300].decode(errors='replace')}"
        elif not reply.done and not reply.error:
            reply.error = "stream ended without [DONE]"
        self._state = "idle"
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(reply)


async def _open(port: int) -> SSEConnection:
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(
        loop.create_connection(SSEConnection, HOST, port), REQUEST_TIMEOUT_S
    )
    return conn


async def _connection(
    port: int, requests: list[bytes], spec: dict[str, Any], stats: ClientStats
) -> None:
    """One keep-alive connection sending requests back to back until the window ends."""
    expected, max_tokens = spec["expected_text"], spec["max_tokens"]
    conn: SSEConnection | None = None
    i = 0
    try:
        while time.monotonic() < stats.window[1]:
            t0 = time.monotonic()
            if conn is None or conn.closed:
                try:
                    conn = await _open(port)
                except (OSError, asyncio.TimeoutError) as exc:
                    stats.error(t0, f"connect: {exc!r}")
                    await asyncio.sleep(0.05)
                    continue
            request = requests[i % len(requests)]
            i += 1
            try:
                reply = await asyncio.wait_for(conn.request(request), REQUEST_TIMEOUT_S)
            except (OSError, ValueError, asyncio.TimeoutError) as exc:
                stats.error(time.monotonic(), f"{type(exc).__name__}: {exc}")
                if conn.transport is not None:
                    conn.transport.close()
                conn = None
                await asyncio.sleep(0.01)
                continue
            t1 = time.monotonic()
            stats.total += 1
            if not reply.keep_alive and conn.transport is not None:
                conn.transport.close()
                conn = None
            if reply.error:
                stats.error(t1, reply.error)
                continue
            if not stats.in_window(t1):
                continue
            intact = (
                reply.text == expected
                and reply.tokens == max_tokens
                and reply.finish_reason == "length"
            )
            if not intact:
                stats.corrupt += 1
                if len(stats.error_samples) < 5:
                    stats.error_samples.append(
                        f"corrupt: {reply.text[:80]!r} ({reply.tokens} tokens, "
                        f"{reply.finish_reason})"
                    )
            stats.requests += 1
            stats.tokens += reply.tokens or 0
            stats.chunks += reply.chunks
            stats.latency.append(t1 - t0)
            if reply.t_first is not None:
                stats.ttft.append(reply.t_first - t0)
    finally:
        if conn is not None and conn.transport is not None:
            conn.transport.close()


async def _client(spec: dict[str, Any]) -> ClientStats:
    stats = ClientStats((spec["window_start"], spec["window_end"]))
    bodies = {
        port: [
            http_request(
                port,
                {
                    "model": MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": spec["max_tokens"],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            for prompt in PROMPTS
        ]
        for port in set(spec["ports"])
    }
    await asyncio.gather(*(_connection(p, bodies[p], spec, stats) for p in spec["ports"]))
    return stats


def run_client(spec: dict[str, Any]) -> int:
    """A client child: its connections (one port each) until the window ends, then drain;
    prints what it saw as JSON."""
    stats = asyncio.run(_client(spec))
    print(json.dumps(stats.as_dict()), flush=True)
    return 0


# -- processes, CPU, pinning ----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks[:8]) - idle) / hz, sum(ticks[:8]) / hz


def wait_quiet(limit_s: float, cores: float = QUIET_CORES, step_s: float = 0.5) -> float:
    """Wait, up to limit_s, until the host has been nearly idle (under `cores` busy) for two
    steps in a row: on a shared machine a try then starts without other work beside it.
    Returns the seconds waited (limit_s or more: it never got quiet)."""
    t0 = time.monotonic()
    quiet = 0
    prev = machine_busy()
    while quiet < 2 and time.monotonic() - t0 < limit_s:
        time.sleep(step_s)
        cur = machine_busy()
        busy = (cur[0] - prev[0]) / max(1e-9, cur[1] - prev[1]) * (os.cpu_count() or 1)
        quiet = quiet + 1 if busy < cores else 0
        prev = cur
    return time.monotonic() - t0


def pin(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of pid onto cpus (threads started later inherit it)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def pin_plan(plan: str, routers: int, cpus: Sequence[int]) -> dict[str, list[int]]:
    """Cores of "router0", "router1" and "load" (the client and fake nodes).

    split: k = min(routers, n - 1) cores (at least 1) go to the routers, the active ones
    spread over them (an idle router sits with them), the rest to the load; shared: all."""
    cpus = sorted(cpus)
    if plan == "shared" or len(cpus) == 1:
        return {"router0": cpus, "router1": cpus, "load": cpus}
    k = max(1, min(routers, len(cpus) - 1))
    mine = cpus[len(cpus) - k :]
    return {
        "router0": [mine[-1]],
        "router1": [mine[0]],
        "load": cpus[: len(cpus) - k],
    }


class Cluster:
    """Two routers and one fake-node process, started once; stopped on exit."""

    def __init__(self, model: Path, args: argparse.Namespace, log_dir: Path) -> None:
        from pdserve.local_cluster import free_port

        self.args = args
        self.log_dir = log_dir
        self.ports = [free_port() for _ in ROUTERS]
        self.control_ports = [free_port() for _ in ROUTERS]
        self.routers: list[subprocess.Popen] = []
        self.fakes: subprocess.Popen | None = None
        self.fake_counts: dict[str, Any] = {}
        self.model = model

    def _log(self, name: str) -> Any:
        return open(self.log_dir / f"{name}.log", "wb")

    def start(self, token_ids: list[int], max_model_len: int) -> None:
        for i, (port, control) in enumerate(zip(self.ports, self.control_ports)):
            cmd = [sys.executable, "-m", "pdserve.router", str(self.model)]
            cmd += ["--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(port)]
            cmd += ["--control-port", str(control), *self.args.router_arg]
            with self._log(f"router{i}") as log:
                self.routers.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
                )
        spec = {
            "routers": [f"{HOST}:{c}" for c in self.control_ports],
            "nodes": self.args.nodes,
            "token_ids": token_ids,
            "tokens_per_message": self.args.tokens_per_message,
            "num_blocks": 65536,
            "max_model_len": max_model_len,
        }
        with self._log("fakes") as log:
            self.fakes = subprocess.Popen(
                [*child_cmd("fakes"), json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, port in enumerate(self.ports):
            self._wait_ready(i, port, deadline)

    def _wait_ready(self, i: int, port: int, deadline: float) -> None:
        """Until the router's /metrics counts every fake node (a node registered, alive)."""
        want = f"pdserve_backend_nodes_colocated {float(self.args.nodes)}"
        while time.monotonic() < deadline:
            if self.routers[i].poll() is not None:
                raise RuntimeError(f"router{i} exited:\n{self.log_tail(f'router{i}')}")
            if self.fakes is not None and self.fakes.poll() is not None:
                raise RuntimeError(f"the fake nodes exited:\n{self.log_tail('fakes')}")
            try:
                url = f"http://{HOST}:{port}/metrics"
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if want in resp.read().decode():
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"router{i} not ready in {START_TIMEOUT_S} s:\n{self.log_tail(f'router{i}')}\n"
            f"fake nodes:\n{self.log_tail('fakes')}"
        )

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        procs = [p for p in [*self.routers, self.fakes] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                out, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate(timeout=10)
            if p is self.fakes and out:
                with contextlib.suppress(ValueError):
                    self.fake_counts = json.loads(out.strip().splitlines()[-1])


def child_cmd(kind: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.bench.router", "--child", kind]


# -- one row --------------------------------------------------------------------------------------


def percentiles(xs: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(xs)
    out = {}
    for q in (50, 90, 99):
        pos = (len(s) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{q}"] = (s[lo] + (s[hi] - s[lo]) * (pos - lo)) * scale
    return out


def measure(
    cluster: Cluster,
    plan: str,
    routers: int,
    concurrency: int,
    sizes: Sizes,
    args: argparse.Namespace,
    expected_text: str,
) -> dict[str, Any]:
    """N requests in flight over `routers` routers under CPU plan `plan`, for one window."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = pin_plan(plan, routers, cpus)
    for i, proc in enumerate(cluster.routers):
        pin(proc.pid, cores[f"router{i}"])
    assert cluster.fakes is not None
    pin(cluster.fakes.pid, cores["load"])
    ports = [cluster.ports[j % routers] for j in range(concurrency)]
    procs = max(1, min(args.client_procs, concurrency))
    start = time.monotonic() + CHILD_START_S + sizes.warmup_s
    window = (start, start + sizes.duration_s)
    clients = []
    for c in range(procs):
        spec = {
            "ports": ports[c::procs],
            "max_tokens": sizes.max_tokens,
            "expected_text": expected_text,
            "window_start": window[0],
            "window_end": window[1],
        }
        clients.append(
            subprocess.Popen(
                [*child_cmd("client"), json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        pin(clients[-1].pid, cores["load"])
    watched = {f"router{i}": p.pid for i, p in enumerate(cluster.routers[:routers])}
    watched["fakes"] = cluster.fakes.pid
    watched.update({f"client{c}": p.pid for c, p in enumerate(clients)})
    time.sleep(max(0.0, window[0] - time.monotonic()))
    cpu0 = {k: cpu_seconds(pid) for k, pid in watched.items()}
    busy0, total0 = machine_busy()
    t0 = time.monotonic()
    time.sleep(max(0.0, window[1] - time.monotonic()))
    cpu1 = {k: cpu_seconds(pid) for k, pid in watched.items()}
    busy1, total1 = machine_busy()
    span = time.monotonic() - t0
    results = []
    for c, proc in enumerate(clients):
        try:
            out, err = proc.communicate(timeout=DRAIN_TIMEOUT_S + REQUEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"client{c} failed ({proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    used = {k: (cpu1[k] - cpu0[k]) / span for k in watched}
    everything = (busy1 - busy0) / max(1e-9, total1 - total0) * (os.cpu_count() or 1)
    merged: dict[str, Any] = {
        k: sum(r[k] for r in results) for k in ("requests", "tokens", "chunks", "corrupt")
    }
    merged["errors"] = sum(r["errors"] for r in results)
    router_cpu = sum(used[f"router{i}"] for i in range(routers)) * span
    duration = sizes.duration_s
    return {
        "pin": plan,
        "routers": routers,
        "concurrency": concurrency,
        "client_procs": procs,
        "duration_s": duration,
        "requests": merged["requests"],
        "requests_per_s": merged["requests"] / duration,
        "output_tokens": merged["tokens"],
        "tokens_per_s": merged["tokens"] / duration,
        "chunks": merged["chunks"],
        "corrupt": merged["corrupt"],
        "errors": merged["errors"],
        "error_samples": [s for r in results for s in r["error_samples"]][:5],
        "ttft_ms": percentiles([x for r in results for x in r["ttft"]]),
        "latency_ms": percentiles([x for r in results for x in r["latency"]]),
        "cpu_cores_used": {
            "routers": [used[f"router{i}"] for i in range(routers)],
            "fakes": used["fakes"],
            "clients": sum(used[f"client{c}"] for c in range(procs)),
            "machine": everything,
            # whatever else ran on the host meanwhile (this process, other work)
            "other": max(0.0, everything - sum(used.values())),
        },
        "router_cpu_ms_per_request": 1000 * router_cpu / max(1, merged["requests"]),
        "router_cpu_us_per_token": 1e6 * router_cpu / max(1, merged["tokens"]),
        "cpus": {k: v for k, v in cores.items() if k != "router1" or routers > 1},
    }


def cost_split(
    cluster: Cluster, n: int, sizes: Sizes, args: argparse.Namespace, expected: str
) -> dict[str, Any]:
    """One router (`split`) at n in flight, its requests' tokens streamed as usual against
    all of them in one `tokens` message (the fake nodes switch on SIGUSR1, back on SIGUSR2):
    the router's fixed CPU per request, and what each further streamed token adds."""
    assert cluster.fakes is not None
    tries: dict[str, list[dict[str, Any]]] = {"streamed": [], "one_message": []}
    for _ in range(sizes.repeats):
        for mode, rows in tries.items():
            if args.quiet_wait:
                wait_quiet(args.quiet_wait)
            if mode == "one_message":
                os.kill(cluster.fakes.pid, signal.SIGUSR1)
            try:
                rows.append(measure(cluster, "split", 1, n, sizes, args, expected))
            finally:
                if mode == "one_message":
                    os.kill(cluster.fakes.pid, signal.SIGUSR2)
            print(f"[cost, {mode}] {_row_line(rows[-1])}", flush=True)
    streamed = min(r["router_cpu_ms_per_request"] for r in tries["streamed"])
    one = min(r["router_cpu_ms_per_request"] for r in tries["one_message"])
    return {
        "concurrency": n,
        "streamed_ms_per_request": streamed,
        "one_message_ms_per_request": one,
        "per_streamed_token_us": 1000 * (streamed - one) / max(1, sizes.max_tokens - 1),
        "rows": {mode: best_try(rows) for mode, rows in tries.items()},
    }


# -- tokens the fake nodes send, and a probe ------------------------------------------------------


def word_tokens(model: Path, k: int = 4) -> tuple[list[int], Any]:
    """The k longest token ids that each decode to a space and a lowercase word, and the
    tokenizer (tokenizers' own: the router's fast tokenizer decodes the same)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=True)
        if text.startswith(" ") and text[1:].isalpha() and text[1:].islower():
            words.append((-len(text), i))
    found = [i for _, i in sorted(words)[:k]]
    if not found:  # no such words: any tokens that decode to something
        found = [i for i in range(16, tok.get_vocab_size()) if tok.decode([i])][:k]
    return found, tok


def probe(port: int, max_tokens: int) -> dict[str, Any]:
    """One streamed request through a router, read whole: the text it returned."""

    async def once() -> Reply:
        conn = await _open(port)
        try:
            body = {
                "model": MODEL_NAME,
                "prompt": PROMPTS[0],
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            return await asyncio.wait_for(conn.request(http_request(port, body)), REQUEST_TIMEOUT_S)
        finally:
            if conn.transport is not None:
                conn.transport.close()

    reply = asyncio.run(once())
    return {
        "status": reply.status,
        "text": reply.text,
        "completion_tokens": reply.tokens,
        "finish_reason": reply.finish_reason,
        "chunks": reply.chunks,
        "error": reply.error,
    }


# -- the report -----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    def has(module: str) -> bool:
        import importlib.util

        return importlib.util.find_spec(module) is not None

    return {
        "cpu_count": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        # uvicorn runs the router on uvloop and httptools when they are installed
        # (uvicorn[standard]); else on asyncio's loop and h11, both pure Python.
        "uvloop": has("uvloop"),
        "httptools": has("httptools"),
    }


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """2 routers / 1 router, per CPU plan and concurrency."""
    by = {(r["pin"], r["concurrency"], r["routers"]): r for r in rows}
    out = []
    for (plan, n, routers), two in by.items():
        one = by.get((plan, n, 1))
        if routers != 2 or one is None:
            continue
        out.append(
            {
                "pin": plan,
                "concurrency": n,
                "requests_per_s": two["requests_per_s"] / max(1e-9, one["requests_per_s"]),
                "tokens_per_s": two["tokens_per_s"] / max(1e-9, one["tokens_per_s"]),
                "router_cpu_ms_per_request": two["router_cpu_ms_per_request"]
                / max(1e-9, one["router_cpu_ms_per_request"]),
            }
        )
    return out


def ceilings(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The best row of each (plan, routers), keyed "plan/routers"."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = f"{r['pin']}/{r['routers']}"
        if key not in best or r["requests_per_s"] > best[key]["requests_per_s"]:
            best[key] = {
                "requests_per_s": r["requests_per_s"],
                "tokens_per_s": r["tokens_per_s"],
                "concurrency": r["concurrency"],
                "router_cores_used": sum(r["cpu_cores_used"]["routers"]),
                "router_cpu_ms_per_request": r["router_cpu_ms_per_request"],
            }
    return best


def best_try(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The try with the most requests/s (other work on the host only ever slows a row down),
    with every try's requests/s beside it."""
    best = dict(max(tries, key=lambda r: r["requests_per_s"]))
    best["tries_requests_per_s"] = [r["requests_per_s"] for r in tries]
    return best


def _row_line(row: dict[str, Any]) -> str:
    return (
        f"{row['pin']:>6} routers={row['routers']} N={row['concurrency']:<4} "
        f"{row['requests_per_s']:8.1f} req/s {row['tokens_per_s']:9.0f} tok/s "
        f"ttft p50 {row['ttft_ms']['p50']:7.1f} ms  router cores "
        f"{sum(row['cpu_cores_used']['routers']):.2f}  "
        f"{row['router_cpu_ms_per_request']:.2f} ms/req  "
        f"other {row['cpu_cores_used']['other']:.2f}  "
        f"errors {row['errors']} corrupt {row['corrupt']}"
    )


def _span(xs: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(xs), max(xs)
    return (
        fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"
    )


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def reading(report: dict[str, Any]) -> str:
    """What the numbers say, in words computed from them."""
    rows = report["rows"]
    ones = [r for r in rows if r["routers"] == 1 and r["requests"]]
    if not ones:
        return ""
    cores = len(report["machine"]["cpus_allowed"])
    tokens = report["sizes"]["max_tokens"]
    best = max(ones, key=lambda r: r["requests_per_s"])
    per_req = [r["router_cpu_ms_per_request"] for r in ones]
    typical = _median(per_req)
    lines = [
        f"- **One router peaked at {best['requests_per_s']:.0f} requests/s, "
        f"{best['tokens_per_s']:,.0f} output tokens/s** (`{best['pin']}`, "
        f"{best['concurrency']} in flight, {sum(best['cpu_cores_used']['routers']):.2f} "
        f"cores). Over all 1-router rows it spent {_span(per_req)} ms of CPU per request of "
        f"{tokens} tokens (median {typical:.2f}): one router on a core of its own proxies "
        f"about {1000 / typical:.0f} requests/s, {1000 * tokens / typical:,.0f} tokens/s, of "
        "this shape, however many nodes stand behind it."
    ]
    cost = report.get("cost_split")
    if cost:
        share = 1 - cost["one_message_ms_per_request"] / cost["streamed_ms_per_request"]
        lines.append(
            f"- **Streamed tokens are {share:.0%} of that cost.** At {cost['concurrency']} in "
            f"flight one router spent {cost['streamed_ms_per_request']:.2f} ms per request "
            f"with the {tokens} tokens streamed one per `tokens` message, and "
            f"{cost['one_message_ms_per_request']:.2f} ms with all of them in one message "
            f"(one SSE chunk): {cost['one_message_ms_per_request']:.2f} ms per request, plus "
            f"{cost['per_streamed_token_us']:.0f} µs per further streamed token (a message "
            "in, a chunk out)."
        )
    for plan in report["sizes"]["pins"]:
        rs = [x for x in report["ratios"] if x["pin"] == plan]
        if not rs:
            continue
        twos = [r for r in rows if r["pin"] == plan and r["routers"] == 2]
        used = max(sum(r["cpu_cores_used"]["routers"]) for r in twos)
        cpu = _span([x["router_cpu_ms_per_request"] for x in rs])
        ratio = _span([x["requests_per_s"] for x in rs])
        where = (
            "both routers on one core, the client and the fake nodes on the other"
            if plan == "split" and cores < 3
            else "a core per router"
            if plan == "split"
            else "nothing pinned"
        )
        lines.append(
            f"- `{plan}` ({where}): **2 routers / 1 router = {ratio}x requests/s** over "
            f"{', '.join(str(x['concurrency']) for x in rs)} in flight, the two routers "
            f"using up to {used:.2f} cores together; router CPU per request {cpu}x."
        )
    if cores < 3:
        lines.append(
            f"- This host has {cores} cores, so no plan gives each router a core of its own "
            "while the client and the fake nodes have one. `split` therefore shows what "
            "spreading one core over two router processes costs, not the gain of a second "
            "core; `shared` shows the gain this host can give: a second router takes what the "
            "client and the fake nodes leave of the second core."
        )
    split_ones = sorted((r for r in ones if r["pin"] == "split"), key=lambda r: r["concurrency"])
    if len(split_ones) > 1:
        lines.append(
            "- One router's CPU per request by requests in flight (`split`): "
            + ", ".join(
                f"{r['concurrency']}: {r['router_cpu_ms_per_request']:.2f} ms" for r in split_ones
            )
            + "."
        )
    spreads = [
        max(t) / min(t) - 1
        for r in rows
        if len(t := r.get("tries_requests_per_s", [])) > 1 and min(t) > 0
    ]
    if spreads:
        lines.append(
            f"- Tries of one row differ by {_median(spreads):.0%} in requests/s (median; up to "
            f"{max(spreads):.0%}), on a host whose other work stayed under "
            f"{max(r['cpu_cores_used'].get('other', 0.0) for r in rows):.2f} cores: read "
            "smaller differences between rows as noise."
        )
    lines.append(
        "- Routers share no state and every node registers with each, so on a host with a "
        "core per router (and cores for the clients) N routers should proxy about N times "
        f"one, N x {1000 / typical:.0f} requests/s of {tokens} tokens"
        + (
            f". A router's limit is streamed tokens, about {1000 * tokens / typical:,.0f} "
            "tokens/s per core here: nodes that together stream more than that need another "
            "router on a core of its own, or a cheaper per-token path in the router."
            if cost and cost["one_message_ms_per_request"] < cost["streamed_ms_per_request"] / 2
            else "."
        )
    )
    return "\n".join(lines)


def section(report: dict[str, Any], figure: str | None) -> str:
    m = report["machine"]
    header = [
        "CPU plan",
        "routers",
        "in flight",
        "req/s",
        "tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "latency p50 ms",
        "latency p99 ms",
        "router cores",
        "client+fakes cores",
        "other cores",
        "router ms/req",
        "errors",
        "corrupt",
    ]
    rows = [
        [
            r["pin"],
            r["routers"],
            r["concurrency"],
            r["requests_per_s"],
            r["tokens_per_s"],
            r["ttft_ms"]["p50"],
            r["ttft_ms"]["p99"],
            r["latency_ms"]["p50"],
            r["latency_ms"]["p99"],
            " + ".join(f"{u:.2f}" for u in r["cpu_cores_used"]["routers"]),
            r["cpu_cores_used"]["clients"] + r["cpu_cores_used"]["fakes"],
            r["cpu_cores_used"]["other"],
            r["router_cpu_ms_per_request"],
            r["errors"],
            r["corrupt"],
        ]
        for r in report["rows"]
    ]
    plans = []
    for plan in report["sizes"]["pins"]:
        for routers in ROUTERS:
            cores = pin_plan(plan, routers, m["cpus_allowed"])
            names = ["router0"] + (["router1"] if routers > 1 else [])
            where = ", ".join(f"{n} on {cores[n]}" for n in names)
            plans.append(f"`{plan}`, {routers} router(s): {where}, client+fakes on {cores['load']}")
    s = report["sizes"]
    text = [
        "## Router ceiling: one router against two (`pdserve bench router`)",
        "",
        "How much one router can proxy, and what a second one adds. "
        f"{report['nodes']} fake colocated nodes answer every request at once "
        f"({s['max_tokens']} tokens, {report['tokens_per_message']} per `tokens` message, as "
        "a decode node streams them), so nothing but the router limits the cluster; every "
        "node registers with both routers, and the client spreads its keep-alive connections "
        "round-robin over the routers in use. Each row keeps N streaming "
        "`/v1/completions` requests in flight for "
        f"{s['duration_s']:g} s after {s['warmup_s']:g} s of warm-up"
        + (
            f", and is the best of {s['repeats']} tries taken in whole passes (other work on "
            "the host only slows a try down)"
            if s.get("repeats", 1) > 1
            else ""
        )
        + (
            f"; before each try the run waits (up to {report['quiet_wait_s']:g} s) for the "
            "host to go idle"
            if report.get("quiet_wait_s")
            else ""
        )
        + "; every reply is checked against the text the fake nodes sent (`corrupt`). Cores "
        "used are CPU seconds per second in the window, from /proc; `other` is the rest of "
        "the host's busy CPU.",
        "",
        f"    {report['command']}",
        "",
        f"Measured {report['date']} on {m['processor']} x{m['cpu_count']} "
        f"({m['platform']}, Python {m['python']}; uvloop: {m['uvloop']}, httptools: "
        f"{m['httptools']}). CPU plans: " + "; ".join(plans) + ".",
        "",
        markdown_table(header, rows),
        "",
        reading(report),
    ]
    if figure:
        text += ["", f"![requests/s and router CPU per request]({figure})"]
    return "\n".join(text) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for plan in report["sizes"]["pins"]:
        for routers in ROUTERS:
            rows = [r for r in report["rows"] if r["pin"] == plan and r["routers"] == routers]
            if not rows:
                continue
            xs = [r["concurrency"] for r in rows]
            style = "-o" if routers == 1 else "--s"
            label = f"{plan}, {routers} router{'s' * (routers > 1)}"
            left.plot(xs, [r["requests_per_s"] for r in rows], style, label=label)
            right.plot(xs, [r["router_cpu_ms_per_request"] for r in rows], style, label=label)
    concurrency = report["sizes"]["concurrency"]
    for ax, title in ((left, "requests/s"), (right, "router CPU ms per request")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(n) for n in concurrency])
        ax.minorticks_off()
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    return save_figure(fig, path)


# -- the command ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench router", __doc__.split("\n\n")[0])
    p.add_argument("--child", choices=("fakes", "client"), help=argparse.SUPPRESS)
    p.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    run = p.add_argument_group("run")
    run.add_argument(
        "--quick", action="store_true", help="seconds: 2 concurrencies, short windows, `split` only"
    )
    run.add_argument(
        "--concurrency", default=None, help="requests in flight, comma-separated (8,16,32,64,128)"
    )
    run.add_argument("--max-tokens", type=int, default=None, help="output tokens per request")
    run.add_argument("--warmup", type=float, default=None, help="seconds before each window")
    run.add_argument("--duration", type=float, default=None, help="seconds each row counts")
    run.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="tries of every row, in whole passes; the report keeps each row's best (2; quick 1)",
    )
    run.add_argument(
        "--pins", default=None, help=f"CPU plans, comma-separated, of {', '.join(PINS)}"
    )
    run.add_argument(
        "--tokens-per-message",
        type=int,
        default=1,
        help="token ids per `tokens` message (1: a decode node's streaming)",
    )
    run.add_argument("--nodes", type=int, default=2, help="fake colocated nodes")
    run.add_argument(
        "--client-procs", type=int, default=1, help="client processes sharing the connections"
    )
    run.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag for both routers (repeat; e.g. --router-arg=--policy=round_robin)",
    )
    run.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        metavar="S",
        help="before each try, wait up to S seconds for the host to be idle (other work on a "
        "shared machine skews a try); 0: never (default 30; quick 0)",
    )
    run.add_argument(
        "--cost-split",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the rows, one router's CPU per request with its tokens streamed against "
        "all in one message: fixed and per-token cost (default: on; quick: off)",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model", type=Path, default=None, help="HF directory for the tokenizer (default: tiny)"
    )
    model.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "pdserve-bench-models",
        help="where the tiny model is kept",
    )
    out = add_output_flags(p, "router_ceiling.json and router_ceiling.png")
    add_from_json_flag(out, "the plot and section of this router_ceiling.json")
    args = p.parse_args(argv)
    if args.child:
        return args
    base = QUICK if args.quick else FULL
    pins = tuple(args.pins.split(",")) if args.pins else base.pins
    if set(pins) - set(PINS):
        p.error(f"--pins: choose from {', '.join(PINS)}")
    args.sizes = Sizes(
        tuple(int(x) for x in args.concurrency.split(","))
        if args.concurrency
        else base.concurrency,
        args.max_tokens or base.max_tokens,
        base.warmup_s if args.warmup is None else args.warmup,
        args.duration or base.duration_s,
        pins,
        args.repeats or base.repeats,
    )
    if args.cost_split is None:
        args.cost_split = not args.quick
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.quick else 30.0
    args.outputs = outputs_from_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child == "fakes":
        return run_fake_nodes(json.loads(args.spec))
    if args.child == "client":
        return run_client(json.loads(args.spec))
    if args.from_json is not None:
        return publish(json.loads(args.from_json.read_text()), args.outputs)
    sizes: Sizes = args.sizes
    model = args.model or cached_model(args.cache_dir, "tiny-llama-router", MODEL_SPEC)
    token_ids, tok = word_tokens(model)
    cycle = [token_ids[i % len(token_ids)] for i in range(sizes.max_tokens)]
    expected = tok.decode(cycle, skip_special_tokens=True)
    config = json.loads((model / "config.json").read_text())
    rows: list[dict[str, Any]] = []
    cost: dict[str, Any] | None = None
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        cluster = Cluster(model, args, Path(tmp))
        try:
            t0 = time.monotonic()
            cluster.start(token_ids, int(config.get("max_position_embeddings", 2048)))
            print(f"2 routers and {args.nodes} fake nodes ready in {time.monotonic() - t0:.1f} s")
            probes = [probe(port, sizes.max_tokens) for port in cluster.ports]
            for i, pr in enumerate(probes):
                if pr["error"] or pr["text"] != expected:
                    raise RuntimeError(f"router{i} probe: {pr} != {expected!r}")
            tries: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
            for rep in range(sizes.repeats):  # whole passes, so a burst of other work on
                for plan in sizes.pins:  # the host hits one try of a row, not all of them
                    for n in sizes.concurrency:
                        for routers in ROUTERS:
                            waited = wait_quiet(args.quiet_wait) if args.quiet_wait else 0.0
                            row = measure(cluster, plan, routers, n, sizes, args, expected)
                            row["quiet_wait_s"] = waited
                            tries.setdefault((plan, n, routers), []).append(row)
                            print(f"[{rep + 1}/{sizes.repeats}] {_row_line(row)}", flush=True)
            rows = [best_try(t) for t in tries.values()]
            if args.cost_split:
                ones = [r for r in rows if r["routers"] == 1 and r["pin"] == "split"]
                if ones:
                    n = max(ones, key=lambda r: r["requests_per_s"])["concurrency"]
                    cost = cost_split(cluster, n, sizes, args, expected)
        finally:
            cluster.stop()
    argv_list = sys.argv[1:] if argv is None else argv
    report = {
        "command": command_line("bench_router.py", list(argv_list)),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_info(),
        "quick": args.quick,
        "sizes": {
            "concurrency": list(sizes.concurrency),
            "max_tokens": sizes.max_tokens,
            "warmup_s": sizes.warmup_s,
            "duration_s": sizes.duration_s,
            "pins": list(sizes.pins),
            "repeats": sizes.repeats,
        },
        "nodes": args.nodes,
        "tokens_per_message": args.tokens_per_message,
        "client_procs": args.client_procs,
        "quiet_wait_s": args.quiet_wait,
        "router_args": args.router_arg,
        "token_ids": token_ids,
        "expected_text": expected,
        "probes": probes,
        "fake_nodes": cluster.fake_counts,
        "rows": rows,
        "ratios": ratios(rows),
        "cost_split": cost,
        "ceilings": ceilings(rows),
    }
    return publish(report, args.outputs)


def publish(report: dict[str, Any], to: Outputs) -> int:
    """router_ceiling.json, its plot and the page's section."""
    print(reading(report))
    report_io.publish("router", report, to, plot, section, stem="router_ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())

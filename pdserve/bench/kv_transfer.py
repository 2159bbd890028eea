"""KV transfer: each connector against its raw transport, sender and receiver in two processes
(`pdserve bench kv-transfer`, `python scripts/bench_kv_transfer.py`)."""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import zmq

from pdserve.bench import report as rp
from pdserve.common.node.cli import parser
from pdserve.common.wire.payloads import FirstToken, transfer_plan
from pdserve.kv_transfer import KVLayout, KVReceiver, create_receiver, create_sender
from pdserve.kv_transfer.wire import FRAME_BYTES, as_bytes, blocks_per_frame
from pdserve.local_cluster import free_port

GOALS = {"zmq": 0.9, "nccl": 0.9, "shm": 0.7, "nixl": 0.9}  # x the raw transport's GB/s
RAW_NAMES = {"zmq": "pyzmq PUSH/PULL", "nccl": "torch.distributed isend/irecv", "shm": "copy_",
             "nixl": "NIXL WRITE"}  # fmt: skip
CONNECTORS = tuple(GOALS)
LAYOUTS = ("tiny", "llama3-8b", "deepseek-v3", "llama3-70b")  # the last two: MLA against GQA
DEFAULT_TOKENS = (128, 512, 2048, 4096, 8192, 32768)
QUICK_TOKENS = (128, 512)
BLOCK_SIZE = 16
OP_TIMEOUT_S = 300.0
SEED = 1234


def make_layouts(device: str) -> dict[str, KVLayout]:
    dtype = "float32" if device == "cpu" else "bfloat16"
    return {
        # common.tiny_model's defaults: 2 layers, 2 KV heads, hidden 64 / 4 heads = head_dim 16
        "tiny": KVLayout("tiny-llama", dtype, 2, 2, 16, BLOCK_SIZE),
        "llama3-8b": KVLayout("llama-3-8b-shaped", dtype, 32, 8, 128, BLOCK_SIZE),
        "deepseek-v3": KVLayout("deepseek-v3-shaped", dtype, 61, 1, 576, BLOCK_SIZE, planes=1),
        "llama3-70b": KVLayout("llama-3-70b-shaped", dtype, 80, 8, 128, BLOCK_SIZE),
    }


@dataclass(frozen=True, slots=True)
class Point:
    """One measurement: a connector moving the KV of `tokens` tokens of one layout."""

    connector: str
    layout_name: str
    layout: KVLayout
    tokens: int

    @property
    def n_blocks(self) -> int:
        return -(-self.tokens // self.layout.block_size)

    @property
    def layer_bytes(self) -> int:
        return self.n_blocks * self.layout.page_bytes

    @property
    def nbytes(self) -> int:
        return self.layout.num_layers * self.layer_bytes

    def frames(self) -> list[list[int]]:
        """[layer, byte offset, bytes] of each frame of at most FRAME_BYTES (whole pages)."""
        step = min(self.n_blocks, blocks_per_frame(self.layout.page_bytes, FRAME_BYTES))
        step *= self.layout.page_bytes
        starts = range(0, self.layer_bytes, step)
        layers = range(self.layout.num_layers)
        return [[i, at, min(step, self.layer_bytes - at)] for i in layers for at in starts]


def skip_reason(point: Point, max_bytes: int, device: str) -> str:
    """Why `point` cannot run here ("": it can)."""
    if point.nbytes > max_bytes:
        return f"KV bytes {point.nbytes / 2**30:.2f} GiB > --max-bytes {max_bytes / 2**30:.2f} GiB"
    if point.connector == "nccl" and device == "cuda" and torch.cuda.device_count() < 2:
        return "NCCL cannot pair two ranks on one GPU; needs two devices"
    if point.connector == "nixl":
        from pdserve.kv_transfer.nixl_agent import nixl_installed

        return "" if nixl_installed() else "nixl extra not installed: pip install 'pdserve[nixl]'"
    return ""


def views(bufs: list[torch.Tensor], frames: list[list[int]]) -> list[torch.Tensor]:
    """The byte ranges [layer, start, bytes] of `frames` in per-layer byte buffers."""
    return [bufs[layer][start : start + n] for layer, start, n in frames]


class Raw:
    """A connector's baseline: the same frames over its bare transport, between this process
    (`open` receiving; per run `expect`, `receive`) and the sender child (`open`; per point
    `prepare`; per run `send`). A `self_timed` baseline ends when the child's send returns."""

    self_timed = False
    sources: list[torch.Tensor]

    def open(self, device: str, port: int, receiving: bool) -> None: ...
    def expect(self, landing: list[torch.Tensor]) -> None: ...
    def receive(self) -> None: ...
    def close(self) -> None: ...

    def describe(self, caches: list[torch.Tensor]) -> dict[str, Any]:
        """What the sender needs of a point's receiving caches (nixl: their descriptors)."""
        return {}

    def prepare(self, child: Sender, target: dict[str, Any]) -> None:
        self.sources = [as_bytes(c) for c in child.caches]

    def send(self, child: Sender, frames: list[list[int]]) -> None:
        raise NotImplementedError


class ZmqRaw(Raw):
    """pyzmq PUSH/PULL: zero-copy sends from host memory, an empty frame to end."""

    sock: zmq.Socket | None = None

    def open(self, device: str, port: int, receiving: bool) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PULL if receiving else zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if receiving else self.sock.connect)(f"tcp://127.0.0.1:{port}")

    def receive(self) -> None:
        assert self.sock is not None
        while self.sock.poll(int(OP_TIMEOUT_S * 1000)):
            if len(self.sock.recv(copy=False).buffer) == 0:
                break

    def prepare(self, child: Sender, target: dict[str, Any]) -> None:
        self.sources = [as_bytes(c.cpu()) for c in child.caches]

    def send(self, child: Sender, frames: list[list[int]]) -> None:
        assert self.sock is not None
        sent = views(self.sources, frames)
        out = [self.sock.send(v.numpy(), copy=False, track=True) for v in sent]
        self.sock.send(b"")
        for tracker in out:
            tracker.wait(OP_TIMEOUT_S)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)


class NcclRaw(Raw):
    """torch.distributed isend/irecv on a plain pair (gloo on CPU), rank 1 receiving."""

    works: list[Any] = []

    def open(self, device: str, port: int, receiving: bool) -> None:
        init_raw_group(int(receiving), port, device)

    def expect(self, landing: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        self.works = [dist.irecv(v, src=0, tag=i) for i, v in enumerate(landing)]

    def receive(self) -> None:
        for work in self.works:
            work.wait()

    def send(self, child: Sender, frames: list[list[int]]) -> None:
        import torch.distributed as dist

        sent = views(self.sources, frames)
        for work in [dist.isend(v, dst=1, tag=i) for i, v in enumerate(sent)]:
            work.wait()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class CopyRaw(Raw):
    """One `copy_` per frame, in the sender's process, into a second buffer."""

    self_timed = True

    def prepare(self, child: Sender, target: dict[str, Any]) -> None:
        super().prepare(child, target)
        self.dest = [torch.empty_like(b) for b in self.sources]

    def send(self, child: Sender, frames: list[list[int]]) -> None:
        for dest, src in zip(views(self.dest, frames), views(self.sources, frames)):
            dest.copy_(src)


class NixlRaw(Raw):
    """The connector's NIXL WRITEs, bare: the same descriptors, timed until they are done."""

    self_timed = True
    target: tuple[str, list[Any], int] | None = None  # remote name, pages, blocks

    def describe(self, caches: list[torch.Tensor]) -> dict[str, Any]:
        from pdserve.kv_transfer.nixl_agent import describe_caches

        target = describe_caches(caches)
        return {**target, "agent": target["agent"].hex()}  # the child's commands are JSON

    def prepare(self, child: Sender, target: dict[str, Any]) -> None:
        from pdserve.kv_transfer.nixl_agent import Agent, remote_pages

        if self.target is not None:
            Agent.get().drop_remote(self.target[0])
        name, pages = remote_pages({**target, "agent": bytes.fromhex(target["agent"])})
        self.target = (name, pages, int(target["num_blocks"]))

    def send(self, child: Sender, frames: list[list[int]]) -> None:
        from pdserve.kv_transfer.nixl_agent import wait_handles, write_pages

        assert self.target is not None
        _, pages, blocks = self.target
        layers = sorted({f[0] for f in frames})
        handles = write_pages(child.caches, pages, blocks, layers, child.src, child.dst)
        wait_handles(handles, OP_TIMEOUT_S)


RAW: dict[str, type[Raw]] = {"zmq": ZmqRaw, "nccl": NcclRaw, "shm": CopyRaw, "nixl": NixlRaw}


def init_raw_group(rank: int, store_port: int, device: str) -> None:
    """The plain torch.distributed pair the raw `nccl` baseline runs on (rank 1 hosts)."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=OP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", store_port, 2, rank == 1, timeout)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timeout)


class Sender:
    """The child's state: caches of the current point, a connector sender, a raw transport.
    Each method is a command from the parent; what it returns goes back as the reply."""

    def __init__(self, connector: str, device: str) -> None:
        two = device == "cuda" and torch.cuda.device_count() > 1  # as two nodes would have
        self.device = ("cuda:1" if two else "cuda:0") if device == "cuda" else "cpu"
        self.connector, self.raw = connector, RAW[connector]()
        self.caches: list[torch.Tensor] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.sender: Any = None

    def connect(self, port: int) -> None:
        self.raw.open(self.device, port, receiving=False)

    def point(self, layout: dict, src: list[int], dst: list[int], endpoint: str, target: dict):
        """A new point: its caches, a sender connected to the receiver at `endpoint`, and the
        raw transport's sources (`target`: what it needs of the receiver's caches)."""
        self.caches = []  # free the last point's tensors first
        kv = KVLayout.from_dict(layout)
        gen = torch.Generator().manual_seed(SEED)
        shape, dtype = kv.page_shape(len(src)), getattr(torch, kv.dtype)
        layers = range(kv.num_layers)
        self.caches = [torch.rand(shape, generator=gen).to(dtype).to(self.device) for _ in layers]
        self.src, self.dst = src, dst
        if self.sender is not None:
            self.sender.close()
        self.sender = create_sender(self.connector, kv)
        self.sender.connect(endpoint, timeout=60.0)
        self.raw.prepare(self, target)

    def send(self, xfer: str) -> dict[str, Any]:
        cpu0, t0 = time.process_time(), time.monotonic()
        send_request(self.sender, xfer, self.caches, self.src, self.dst)
        return {"t0": t0, "cpu": time.process_time() - cpu0, "sent": self.sender.bytes_sent}

    def send_raw(self, frames: list[list[int]]) -> dict[str, Any]:
        cpu0, t0 = time.process_time(), time.monotonic()
        self.raw.send(self, frames)
        rp.sync(self.device)
        return {"t0": t0, "t_done": time.monotonic(), "cpu": time.process_time() - cpu0}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.raw.close()


def send_request(sender: Any, xfer: str, caches: list, src: list[int], dst: list[int],
                 heads: Any = None) -> None:  # fmt: skip
    """One request's pages of every layer (with `heads`: those KV heads only), its done message,
    flushed: what a prefill node's rank sends."""
    for layer, cache in enumerate(caches):
        sender.send_layer(xfer, layer, src, dst, cache, heads)
    sender.send_done(xfer, FirstToken(token_id=0))
    sender.flush(OP_TIMEOUT_S)


def pump(receivers: list[KVReceiver], busy: Callable[[], bool], oks: list | None = None) -> None:
    """Poll the receivers while busy() (at most OP_TIMEOUT_S); each result's ok into `oks`."""
    deadline = time.monotonic() + OP_TIMEOUT_S
    while busy():
        assert time.monotonic() < deadline, "a transfer hung"
        for r in receivers:
            done = [x.ok for x in r.poll(0.001)]
            if oks is not None:
                oks.extend(done)


def group_transfer_s(layout: KVLayout, p: int, d: int, blocks: int) -> float:
    """Seconds to move one request's KV (`blocks` blocks of every layer) from a prefill group at
    TP p to a decode group at TP d over zmq on loopback (`bench tp`): each slice of
    `transfer_plan` sent by its prefill rank's thread, every decode rank's receiver polled here."""
    plan = transfer_plan(layout.num_kv_heads, p, d)
    rank = lambda n: replace(layout, num_kv_heads=layout.num_kv_heads // n)  # noqa: E731
    dtype, ids = getattr(torch, layout.dtype), list(range(blocks))
    caches = lambda n, fill: [fill(rank(n).page_shape(blocks)).to(dtype)  # noqa: E731
                              for _ in range(layout.num_layers)]  # fmt: skip
    recv = [create_receiver("zmq", layout, caches(d, torch.zeros)) for _ in range(d)]
    src = [caches(p, torch.randn) for _ in range(p)]
    senders = [create_sender("zmq", layout) for _ in plan]
    connect = [threading.Thread(target=s.connect, args=(recv[x.dst_rank].endpoint,))
               for s, x in zip(senders, plan, strict=True)]  # fmt: skip
    for t in connect:
        t.start()
    pump(recv, lambda: any(t.is_alive() for t in connect))
    for x in plan:
        recv[x.dst_rank].expect(f"x.{x.src_rank}", ids, range(x.dst_offset, x.dst_offset + x.count))

    def ship(i: int) -> None:
        for s, x in zip(senders, plan):
            if x.src_rank == i:
                heads = range(x.src_offset, x.src_offset + x.count)
                send_request(s, f"x.{i}", src[i], ids, ids, heads)

    start, done = time.perf_counter(), []
    shippers = [threading.Thread(target=ship, args=(i,)) for i in range(p)]
    for t in shippers:
        t.start()
    pump(recv, lambda: len(done) < len(plan), done)
    elapsed = time.perf_counter() - start
    assert all(done), "a slice failed"
    for t in shippers:
        t.join()
    for end in [*senders, *recv]:
        end.close()
    return elapsed


def child_main(connector: str, device: str, threads: str) -> None:
    """JSON lines in on stdin, one reply line out per command; stray C prints go to stderr."""
    if device == "cpu":
        torch.set_num_threads(int(threads))
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    state = Sender(connector, device)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply = {"ok": True, **(getattr(state, op)(**cmd) or {})}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    state.close()


class Child:
    """The sender process seen from here: one JSON line per command, one reply line back."""

    def __init__(self, connector: str, device: str) -> None:
        cmd = [sys.executable, "-m", "pdserve.bench.kv_transfer", "--child", connector, device]
        cmd.append(str(torch.get_num_threads()))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def start(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def poll(self) -> dict[str, Any] | None:
        """The reply if it came (one command is out at a time, so a readable pipe holds one
        whole line); RuntimeError for an error reply or a dead child."""
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], 0)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sender child died (exit {self.proc.wait(timeout=30)})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"sender child: {reply['error']}")
        return reply

    def wait(self, idle: Callable[[], None] = lambda: time.sleep(0.01)) -> dict[str, Any]:
        """The reply to the last command, running `idle` until it comes."""
        deadline = time.monotonic() + OP_TIMEOUT_S
        while (reply := self.poll()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sender child did not answer in {OP_TIMEOUT_S} s")
            idle()
        return reply

    def close(self) -> None:
        """End of input ends the child (it closes its sender and transport first)."""
        try:
            self.proc.communicate(timeout=30)
        finally:
            self.proc.kill()


class Run(NamedTuple):
    """One timed transfer: wall seconds and CPU seconds of both processes together."""

    seconds: float
    cpu: float
    sent: int = 0  # the connector sender's bytes_sent counter after it (not the raw transport's)


def summary(conn: list[Run], raw: list[Run], nbytes: int) -> dict[str, Any]:
    """Medians of the connector's runs and the raw transport's, as rates and their ratio."""
    out = {}
    for prefix, runs in (("", conn), ("raw_", raw)):
        ms = statistics.median(r.seconds for r in runs) * 1e3
        out |= {f"{prefix}ms": ms, f"{prefix}gb_s": nbytes / ms / 1e6,
                f"{prefix}cpu_s_per_gb": statistics.median(r.cpu for r in runs) / nbytes * 1e9,
                f"{prefix}samples_ms": [r.seconds * 1e3 for r in runs]}  # fmt: skip
    return out | {"ratio": out["raw_ms"] / out["ms"]}


class Bench:
    """Receiver side of one connector's runs: a receiver per point and the raw transport."""

    def __init__(self, connector: str, device: str) -> None:
        self.device, self.raw = device, RAW[connector]()
        self.child = Child(connector, device)
        self.receiver: KVReceiver | None = None
        self.results: dict[str, Any] = {}
        self.sent = 0
        try:
            port = free_port()
            self.child.start("connect", port=port)
            self.raw.open(device, port, receiving=True)
            self.child.wait()
        except BaseException:
            self.close()
            raise

    def pump(self) -> None:
        assert self.receiver is not None
        for result in self.receiver.poll(0.01):
            self.results[result.xfer_id] = result

    def transfer(self, dst: list[int]) -> tuple[Run, str]:
        """One connector transfer of every layer: its Run, and its error ("" when intact)."""
        assert self.receiver is not None
        self.sent += 1
        xfer = f"b{self.sent}"
        self.receiver.expect(xfer, dst)
        cpu0 = time.process_time()
        self.child.start("send", xfer=xfer)
        deadline, reply = time.monotonic() + OP_TIMEOUT_S, None
        while xfer not in self.results:
            assert time.monotonic() < deadline, f"transfer {xfer} did not finish"
            self.pump()
            reply = reply or self.child.poll()  # the sender's failure ends the wait
        rp.sync(self.device)
        t_end, cpu = time.monotonic(), time.process_time() - cpu0
        reply = reply or self.child.wait(self.pump)
        result = self.results.pop(xfer)
        run = Run(t_end - reply["t0"], cpu + reply["cpu"], reply["sent"])
        return run, "" if result.ok else result.error

    def raw_run(self, frames: list[list[int]], landing: list[torch.Tensor]) -> Run:
        """The same frames over the bare transport."""
        self.raw.expect(views(landing, frames))
        cpu0 = time.process_time()
        self.child.start("send_raw", frames=frames)
        self.raw.receive()
        rp.sync(self.device)
        t_end, cpu = time.monotonic(), time.process_time() - cpu0
        reply = self.child.wait()
        end = reply["t_done"] if self.raw.self_timed else t_end
        return Run(end - reply["t0"], cpu + reply["cpu"])

    def run_point(self, point: Point, repeats: int) -> dict[str, Any]:
        """The point's receiver and the child's sender, a warm-up, then `repeats` transfers
        each followed by its raw baseline."""
        gen = torch.Generator().manual_seed(point.tokens)
        src = torch.randperm(point.n_blocks, generator=gen).tolist()
        dst = torch.randperm(point.n_blocks, generator=gen).tolist()
        kv = point.layout
        caches = [torch.zeros(kv.page_shape(point.n_blocks), dtype=getattr(torch, kv.dtype),
                              device=self.device) for _ in range(kv.num_layers)]  # fmt: skip
        self.receiver = create_receiver(point.connector, kv, caches)
        try:
            target, endpoint = self.raw.describe(caches), self.receiver.endpoint
            self.child.start("point", layout=kv.to_dict(), src=src, dst=dst,
                             endpoint=endpoint, target=target)  # fmt: skip
            self.child.wait(self.pump)
            frames, landing = point.frames(), [as_bytes(c) for c in caches]
            runs = [(self.transfer(dst), self.raw_run(frames, landing)) for _ in range(repeats + 1)]
            received = self.receiver.bytes_received  # the connectors' own counters, per transfer
        finally:
            self.receiver.close()
            self.receiver = None
        errors = sorted({error for (_, error), _ in runs if error})
        conn, raw = [run for (run, _), _ in runs[1:]], [raw for _, raw in runs[1:]]
        sizes = {k: getattr(point, k) for k in ("connector", "tokens", "n_blocks", "layer_bytes")}
        return sizes | {
            "layout": point.layout_name, "bytes": point.nbytes, "frame_bytes": frames[0][2],
            "frames_per_layer": len(frames) // point.layout.num_layers, "ok": not errors,
            "errors": errors, "whole": summary(conn, raw, point.nbytes),
            "bytes_sent": conn[-1].sent / len(runs), "bytes_received": received / len(runs),
            "goal": GOALS[point.connector],
        }  # fmt: skip

    def close(self) -> None:
        try:
            self.child.close()
        finally:
            self.raw.close()


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per connector: the ratio at its largest point and how many points meet the goal."""
    out: dict[str, Any] = {}
    for connector in CONNECTORS:
        if not (mine := [r for r in results if r["connector"] == connector]):
            continue
        largest = max(mine, key=lambda r: (r["bytes"], r["tokens"]))
        ratios = [r["whole"]["ratio"] for r in mine]
        at = {f"{k}_at_largest": largest["whole"][k] for k in ("ratio", "gb_s", "raw_gb_s")}
        out[connector] = at | {
            "goal": GOALS[connector], "points": len(mine),
            "median_ratio": statistics.median(ratios),
            "largest": f"{largest['layout']} {fmt_tokens(largest['tokens'])} tokens",
            "points_meeting_goal": sum(r >= GOALS[connector] for r in ratios),
        }  # fmt: skip
    return out


def connector_tables(report: dict[str, Any]) -> list[str]:
    """The goals at each connector's largest point, then each connector across its points."""
    summary = report["summary"]
    summary = {c: summary[c] for c in CONNECTORS if c in summary}
    goals = [
        rp.goal(f"{c} >= {s['goal']} x raw {RAW_NAMES[c]} GB/s ({s['largest']})",
             s["gb_s_at_largest"], s["raw_gb_s_at_largest"], ">=", s["goal"])
        for c, s in summary.items()
    ]  # fmt: skip
    intact = sum(r["ok"] for r in report["results"])
    goals.append(rp.goal("every transfer intact", intact, len(report["results"]), ">=", 1.0))
    header = ["connector", "points meeting its goal", "median ratio"]
    rows = [
        [c, f"{s['points_meeting_goal']} of {s['points']}", s["median_ratio"]]
        for c, s in summary.items()
    ]
    return [rp.goals_table(goals), "", rp.markdown_table(header, rows)]


COLUMNS = [
    ("layout", "layout"),
    ("tokens", lambda r: fmt_tokens(r["tokens"])),
    ("MiB", lambda r: r["bytes"] / 2**20),
    ("connector", "connector"),
    *[(header, lambda r, k=key: r["whole"][k]) for header, key in
      (("ms", "ms"), ("GB/s", "gb_s"), ("raw GB/s", "raw_gb_s"), ("ratio", "ratio"))],
    ("CPU s/GB (raw)", lambda r: f"{r['whole']['cpu_s_per_gb']:.2f} "
     f"({r['whole']['raw_cpu_s_per_gb']:.2f})"),
    ("counted B/token (per layer)", lambda r: f"{r['bytes_received'] / r['tokens']:.0f} "
     f"({r['bytes_received'] / r['tokens'] * r['layer_bytes'] / r['bytes']:.0f})"),
]  # fmt: skip


def section(report: dict[str, Any], figure: str) -> str:
    """The benchmarks.md section; `figure` is the plot's path as the page links it."""
    results = sorted(report["results"], key=lambda r: (r["layout"], r["tokens"], r["connector"]))
    lines = ["## KV transfer: connectors against their raw transport", ""]
    lines += [*rp.run_header(report, "torch threads per process"), ""]
    lines += [rp.records_table(COLUMNS, results), "", f"![KV transfer GB/s]({figure})", ""]
    lines += connector_tables(report)
    if report["skipped"]:
        groups: dict[tuple[str, str, str], list[str]] = {}
        for s in report["skipped"]:
            key = (s["layout"], fmt_tokens(s["tokens"]), s["reason"])
            groups.setdefault(key, []).append(s["connector"])
        rows = [[lay, n, ", ".join(cs), why] for (lay, n, why), cs in groups.items()]
        header = ["layout", "tokens", "connectors", "reason"]
        lines += ["", "Skipped points:", "", rp.markdown_table(header, rows)]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    """GB/s of each connector and its raw transport against prompt tokens, per layout."""
    panels = []
    for name in sorted({r["layout"] for r in report["results"]}):
        mine = [r for r in report["results"] if r["layout"] == name]
        mine.sort(key=lambda r: r["tokens"])
        title = f"{name} layout ({report['layouts'][name]['dtype']})"
        ticks = sorted({r["tokens"] for r in mine})
        panel = rp.Panel(title, "prompt tokens", "GB/s (whole transfer)", xlog=2, xticks=ticks)
        for i, connector in enumerate(CONNECTORS):
            rows = [r for r in mine if r["connector"] == connector]
            x = [r["tokens"] for r in rows]
            panel.lines.append((connector, x, [r["whole"]["gb_s"] for r in rows], f"o-C{i}"))
            raw = [r["whole"]["raw_gb_s"] for r in rows]
            panel.lines.append((f"raw {RAW_NAMES[connector]}", x, raw, f"s--C{i}"))
        panels.append(panel)
    return rp.plot_lines(panels, path, width=6.0)


def parse_size(text: str) -> int:
    """`2G`, `512M`, `1.5GiB`, `4096` -> bytes (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))


def parse_tokens(text: str) -> list[int]:
    """`128,2k,32k` -> [128, 2048, 32768]."""
    items = [item.strip().lower() for item in text.split(",")]
    out = [int(float(i[:-1]) * 1024) if i.endswith("k") else int(i) for i in items]
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"bad token list {text!r}")
    return out


FLAGS = [
    ("--quick", bool, None, "tiny layout, 128 and 512 tokens, 2 repeats: seconds (needs --out)"),
    ("--connectors", str, ",".join(CONNECTORS), "connectors to measure, a comma list"),
    ("--layouts", str, None, f"KV layouts, a comma list of {', '.join(LAYOUTS)} (default: tiny,"
     "llama3-8b; quick: tiny)"),
    ("--tokens", parse_tokens, None, "prompt lengths in tokens, a comma list, k = 1024 (default: "
     "128,512,2k,4k,8k,32k; quick: 128,512)", {"metavar": "N,N,..."}),
    ("--repeats", int, None, "timed transfers per point, the median reported (default: 5; "
     "quick: 2)"),
    ("--max-bytes", parse_size, parse_size("512M"), "skip points whose KV bytes (one side) "
     "exceed this, binary units: 512M, 2G (default: 512M)", {"metavar": "SIZE"}),
    ("--device", str, "cpu", "where the KV is", {"choices": ("cpu", "cuda")}),
    ("--threads", int, 1, "torch threads per process on CPU (1: two processes on two cores)"),
]  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser("pdserve bench kv-transfer", __doc__.split("\n\n")[0])
    rp.add_flags(p.add_argument_group("run"), FLAGS)
    rp.add_output_flags(p, "kv_transfer.json and kv_transfer.png", "kv_transfer.json")
    args = p.parse_args(argv)
    args.outputs = rp.outputs_from_args(p, args)
    args.connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    if not args.connectors or set(args.connectors) - set(CONNECTORS):
        p.error(f"--connectors must name some of {CONNECTORS}")
    args.layouts = (args.layouts or ("tiny" if args.quick else "tiny,llama3-8b")).split(",")
    if set(args.layouts) - set(LAYOUTS):
        p.error(f"--layouts must name some of {LAYOUTS}")
    args.tokens = args.tokens or list(QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    layouts = {n: lay for n, lay in make_layouts(args.device).items() if n in args.layouts}
    points = [Point(c, name, lay, n) for c in args.connectors
              for name, lay in layouts.items() for n in args.tokens]  # fmt: skip
    why = {p: skip_reason(p, args.max_bytes, args.device) for p in points}
    skipped = [{"connector": p.connector, "layout": p.layout_name, "tokens": p.tokens,
                "bytes": p.nbytes, "reason": why[p]} for p in points if why[p]]  # fmt: skip
    points = [p for p in points if not why[p]]
    results = []
    for connector in args.connectors:
        if mine := [p for p in points if p.connector == connector]:
            results += run_connector(connector, mine, args.repeats, args.device)
    return {
        "device": args.device, "repeats": args.repeats, "max_bytes": args.max_bytes,
        "layouts": {n: {**lay.to_dict(), "bytes_per_token": lay.page_bytes * lay.num_layers
                        // lay.block_size} for n, lay in layouts.items()},
        "results": results, "skipped": skipped, "summary": summarize(results),
    }  # fmt: skip


def run_connector(connector: str, points: list[Point], repeats: int, device: str) -> list[dict]:
    bench = Bench(connector, device)
    try:
        results = []
        for point in points:
            results.append(bench.run_point(point, repeats))
            print(rp.record_line([*COLUMNS[:8], ("intact", "ok")], results[-1]), flush=True)
        return results
    finally:
        bench.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    def write(report: dict[str, Any], to: rp.Outputs) -> None:
        for s in report["skipped"]:
            print(f"skipped {s['connector']} {s['layout']} {fmt_tokens(s['tokens'])}:", s["reason"])
        rp.publish("kv_transfer", report, to, plot, section)

    return rp.bench_main(argv, parse_args, "kv_transfer", measure, write)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # the sender process of `Child`
        child_main(*sys.argv[2:])
    else:
        main()

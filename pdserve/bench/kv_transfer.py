"""KV transfer: each connector against its raw transport, sender and receiver in two processes.
Definitions: docs/benchmarks.md.

    pdserve bench kv-transfer [--quick --out DIR]      # = python scripts/bench_kv_transfer.py
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import zmq

from pdserve.bench.report import (
    add_flags,
    add_from_json_flag,
    add_output_flags,
    best_time,
    goal,
    goals_table,
    markdown_table,
    measure_or_load,
    outputs_from_args,
    publish,
    pyplot,
    record_line,
    records_table,
    run_header,
    save_figure,
    sync,
)
from pdserve.common.node.cli import parser
from pdserve.common.wire.payloads import FirstToken
from pdserve.kernels import ops
from pdserve.kv_transfer import KVLayout, KVReceiver, create_receiver, create_sender
from pdserve.kv_transfer.wire import FRAME_BYTES, as_bytes, blocks_per_frame, page_checksum
from pdserve.local_cluster import free_port

CONNECTORS = ("zmq", "nccl", "shm", "nixl")
GOALS = {"zmq": 0.9, "nccl": 0.9, "shm": 0.7, "nixl": 0.9}
RAW_NAMES = {
    "zmq": "pyzmq PUSH/PULL",
    "nccl": "torch.distributed isend/irecv",
    "shm": "copy_",
    "nixl": "NIXL WRITE",
}
LAYOUTS = ("tiny", "llama3-8b")
DEFAULT_TOKENS = (128, 512, 2048, 4096, 8192, 32768)
QUICK_TOKENS = (128, 512)
SHM_STAGING_BYTES = 32 << 20  # the shm connector's default ring, passed explicitly
BLOCK_SIZE = 16
OP_TIMEOUT_S = 300.0
SEED = 1234


# -- layouts and points -------------------------------------------------------------------------


def make_layouts(device: str) -> dict[str, KVLayout]:
    dtype = "float32" if device == "cpu" else "bfloat16"
    return {
        # common.tiny_model's defaults: 2 layers, 2 KV heads, hidden 64 / 4 heads = head_dim 16
        "tiny": KVLayout("tiny-llama", dtype, 2, 2, 16, BLOCK_SIZE),
        "llama3-8b": KVLayout("llama-3-8b-shaped", dtype, 32, 8, 128, BLOCK_SIZE),
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

    def frames(self, layers: Sequence[int]) -> list[tuple[int, int, int]]:
        """(layer, byte offset, bytes) of each frame the connector sends for `layers`: frames
        of at most FRAME_BYTES, and for shm at most its staging ring."""
        limit = FRAME_BYTES
        if self.connector == "shm":
            limit = min(limit, SHM_STAGING_BYTES)
        per_frame = min(self.n_blocks, blocks_per_frame(self.layout.page_bytes, limit))
        step = per_frame * self.layout.page_bytes
        return [
            (layer, start, min(step, self.layer_bytes - start))
            for layer in layers
            for start in range(0, self.layer_bytes, step)
        ]


def plan(
    args: argparse.Namespace, layouts: dict[str, KVLayout]
) -> tuple[list[Point], list[dict[str, Any]]]:
    """The points to run and, for the others, why not."""
    points, skipped = [], []
    for connector in args.connectors:
        for name, layout in layouts.items():
            for n in args.tokens:
                point = Point(connector, name, layout, n)
                reason = skip_reason(point, args.max_bytes, args.device)
                if not reason:
                    points.append(point)
                    continue
                skip = {"connector": connector, "layout": name, "tokens": n}
                skipped.append({**skip, "bytes": point.nbytes, "reason": reason})
    return points, skipped


def skip_reason(point: Point, max_bytes: int, device: str) -> str:
    if point.nbytes > max_bytes:
        return f"KV bytes {point.nbytes / 2**30:.2f} GiB > --max-bytes {max_bytes / 2**30:.2f} GiB"
    if point.connector == "nccl" and device == "cuda" and torch.cuda.device_count() < 2:
        return "NCCL cannot pair two ranks on one GPU; needs two devices"
    if point.connector == "nixl":
        from pdserve.kv_transfer import TransferError
        from pdserve.kv_transfer.nixl_agent import load_nixl

        try:
            load_nixl()
        except TransferError:
            return "nixl extra not installed: pip install 'pdserve[nixl]'"
    return ""


# -- the sender child ---------------------------------------------------------------------------


def child_device(device: str) -> str:
    """Sender's device: a second GPU when there is one, as two nodes would have."""
    if device == "cuda":
        return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    return "cpu"


class Sender:
    """The child's state: caches of the current point, a connector sender, a raw transport.
    Each method is a command from the parent; what it returns goes back as the reply."""

    def __init__(self, connector: str, device: str) -> None:
        self.connector = connector
        self.device = child_device(device)
        self.caches: list[torch.Tensor] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.sender: Any = None
        self.push: zmq.Socket | None = None
        self.host_bytes: list[torch.Tensor] = []
        self.nixl_target: tuple[str, list[Any], int] | None = None  # name, pages, blocks

    def point(
        self, layout: dict[str, Any], src: list[int], dst: list[int], endpoint: str, target: dict
    ) -> None:
        """A new point: its caches, a sender connected to the receiver at `endpoint`, and for
        nixl the receiver's caches (`target`) as the raw baseline's destination."""
        self.caches, self.host_bytes = [], []  # free the last point's tensors first
        kv = KVLayout.from_dict(layout)
        gen = torch.Generator().manual_seed(SEED)
        shape, dtype = kv.page_shape(len(src)), getattr(torch, kv.dtype)
        layers = range(kv.num_layers)
        self.caches = [torch.rand(shape, generator=gen).to(dtype).to(self.device) for _ in layers]
        if self.connector == "zmq" and self.device != "cpu":
            self.host_bytes = [as_bytes(c.cpu()) for c in self.caches]
        self.src, self.dst = src, dst
        if self.sender is not None:
            self.sender.close()
        self.sender = create_sender(self.connector, kv)
        self.sender.connect(endpoint, timeout=60.0)
        if target:
            self._nixl_target(target)

    def send(self, xfer: str, layers: list[int]) -> dict[str, Any]:
        calls = []
        cpu0, t0 = time.process_time(), time.monotonic()
        for layer in layers:
            start = time.monotonic()
            self.sender.send_layer(xfer, layer, self.src, self.dst, self.caches[layer])
            calls.append(time.monotonic() - start)
        t_layers = time.monotonic()
        self.sender.send_done(xfer, FirstToken(token_id=0))
        self.sender.flush(OP_TIMEOUT_S)
        cpu = time.process_time() - cpu0
        return {"t0": t0, "t_layers": t_layers, "calls": calls, "cpu": cpu}

    def raw_setup(self, endpoint: str = "", store_port: int = 0) -> None:
        if self.connector == "zmq":
            self.push = zmq.Context.instance().socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 0)
            self.push.connect(endpoint)
        elif self.connector == "nccl":
            init_raw_group(rank=0, store_port=store_port, device=self.device)

    def _nixl_target(self, target: dict[str, Any]) -> None:
        from pdserve.kv_transfer.nixl_agent import Agent, remote_pages

        if self.nixl_target is not None:
            Agent.get().drop_remote(self.nixl_target[0])
        name, pages = remote_pages({**target, "agent": bytes.fromhex(target["agent"])})
        self.nixl_target = (name, pages, int(target["num_blocks"]))

    def raw(self, frames: list[list[int]]) -> dict[str, Any]:
        if self.connector == "nixl":
            return self._raw_nixl(sorted({f[0] for f in frames}))
        sources = self.host_bytes or [as_bytes(c) for c in self.caches]
        views = [sources[layer][start : start + n] for layer, start, n in frames]
        cpu0, t0 = time.process_time(), time.monotonic()
        if self.connector == "zmq":
            assert self.push is not None
            trackers = [self.push.send(v.numpy(), copy=False, track=True) for v in views]
            self.push.send(b"")
            for tracker in trackers:
                tracker.wait(OP_TIMEOUT_S)
        elif self.connector == "nccl":
            import torch.distributed as dist

            for work in [dist.isend(v, dst=1, tag=i) for i, v in enumerate(views)]:
                work.wait()
        return {"t0": t0, "cpu": time.process_time() - cpu0}

    def _raw_nixl(self, layers: list[int]) -> dict[str, Any]:
        """The connector's WRITEs, bare: the same descriptors, timed until they are done."""
        from pdserve.kv_transfer.nixl_agent import wait_handles, write_pages

        assert self.nixl_target is not None
        _, pages, blocks = self.nixl_target
        cpu0, t0 = time.process_time(), time.monotonic()
        handles = write_pages(self.caches, pages, blocks, layers, self.src, self.dst)
        wait_handles(handles, OP_TIMEOUT_S)
        t_done = time.monotonic()
        return {"t0": t0, "t_done": t_done, "cpu": time.process_time() - cpu0}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.push is not None:
            self.push.close(linger=0)
        if self.connector == "nccl":
            close_raw_group()


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


def close_raw_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def child_main(connector: str, device: str) -> None:
    """JSON lines in on stdin, one reply line out per command; stray C prints go to stderr."""
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
        if op == "close":
            break


class Child:
    """The sender process seen from here; `wait` keeps `idle` (the receiver's poll) running."""

    def __init__(self, connector: str, device: str) -> None:
        threads = str(torch.get_num_threads())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.bench.kv_transfer", "--child", connector]
            + ["--device", device, "--threads", threads],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))

    def start(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def poll(self) -> dict[str, Any] | None:
        """The next reply if one came; RuntimeError for an error reply or a dead child."""
        try:
            reply = self._replies.get_nowait()
        except queue.Empty:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sender child died (exit {self.proc.returncode})") from None
            return None
        if not reply["ok"]:
            raise RuntimeError(f"sender child: {reply['error']}")
        return reply

    def wait(self, idle: Callable[[], None] | None = None) -> dict[str, Any]:
        """The reply to the last command, running `idle` (or sleeping) until it comes."""
        deadline = time.monotonic() + OP_TIMEOUT_S
        while (reply := self.poll()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sender child did not answer in {OP_TIMEOUT_S} s")
            if idle:
                idle()
            else:
                time.sleep(0.01)
        return reply

    def call(self, op: str, idle: Callable[[], None] | None = None, **args: Any) -> dict:
        self.start(op, **args)
        return self.wait(idle)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("close")
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)


# -- receiver side: one point --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """One timed transfer: wall seconds and CPU seconds of both processes together."""

    seconds: float
    cpu: float


@dataclass
class Samples:
    """The repeats of one kind of measurement, connector and raw interleaved."""

    conn: list[Run] = field(default_factory=list)
    raw: list[Run] = field(default_factory=list)

    def summary(self, nbytes: int) -> dict[str, Any]:
        ms = statistics.median(r.seconds for r in self.conn) * 1e3
        raw_ms = statistics.median(r.seconds for r in self.raw) * 1e3
        cpu = statistics.median(r.cpu for r in self.conn)
        raw_cpu = statistics.median(r.cpu for r in self.raw)
        return {
            "ms": ms,
            "gb_s": nbytes / ms / 1e6,
            "raw_ms": raw_ms,
            "raw_gb_s": nbytes / raw_ms / 1e6,
            "ratio": raw_ms / ms,
            "cpu_s_per_gb": cpu / nbytes * 1e9,
            "raw_cpu_s_per_gb": raw_cpu / nbytes * 1e9,
            "samples_ms": [r.seconds * 1e3 for r in self.conn],
            "raw_samples_ms": [r.seconds * 1e3 for r in self.raw],
        }


class Bench:
    """Receiver side of one connector's runs: a receiver per point and the raw transport."""

    def __init__(self, connector: str, device: str) -> None:
        self.connector, self.device = connector, device
        self.child = Child(connector, device)
        self.receiver: KVReceiver | None = None
        self.receiver_layers = 0
        self.results: dict[str, Any] = {}
        self.pull: zmq.Socket | None = None
        self._xfers = 0
        try:
            self._raw_setup()
        except BaseException:
            self.close()
            raise

    def _raw_setup(self) -> None:
        if self.connector == "zmq":
            self.pull = zmq.Context.instance().socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            port = self.pull.bind_to_random_port("tcp://127.0.0.1")
            self.child.call("raw_setup", endpoint=f"tcp://127.0.0.1:{port}")
        elif self.connector == "nccl":
            port = free_port()
            self.child.start("raw_setup", store_port=port)
            init_raw_group(rank=1, store_port=port, device=self.device)
            self.child.wait()

    def pump(self) -> None:
        assert self.receiver is not None
        for result in self.receiver.poll(0.01):
            self.results[result.xfer_id] = result

    def transfer(self, dst: list[int], layers: list[int]) -> dict[str, Any]:
        """One connector transfer of `layers`: its Run, sender call times, tail, ok."""
        assert self.receiver is not None
        self._xfers += 1
        xfer = f"b{self._xfers}"
        self.receiver.expect(xfer, dst)
        cpu0 = time.process_time()
        self.child.start("send", xfer=xfer, layers=layers)
        deadline, reply = time.monotonic() + OP_TIMEOUT_S, None
        while xfer not in self.results:
            assert time.monotonic() < deadline, f"transfer {xfer} did not finish"
            self.pump()
            reply = reply or self.child.poll()  # the sender's failure ends the wait
        sync(self.device)
        t_end, cpu = time.monotonic(), time.process_time() - cpu0
        reply = reply or self.child.wait(self.pump)
        result = self.results.pop(xfer)
        return {
            "run": Run(t_end - reply["t0"], cpu + reply["cpu"]),
            "tail": t_end - reply["t_layers"],
            "calls": reply["calls"],
            "ok": result.ok or self._only_unsent_layers(result.error, layers),
            "error": result.error,
        }

    def _only_unsent_layers(self, error: str, layers: list[int]) -> bool:
        """nixl admits a transfer only with every layer's pages: a one-layer run (the
        `layer` measurement) fails on exactly that, and is still a clean transfer to time."""
        if len(layers) == self.receiver_layers:
            return False
        return re.fullmatch(r"layer \d+: 0 pages written of \d+", error) is not None

    def raw(self, point: Point, layers: list[int], landing: list[torch.Tensor]) -> Run:
        """The same frames over the bare transport."""
        frames = point.frames(layers)
        if self.connector == "shm":
            return memcpy_frames(frames, landing, self.device)
        cpu0 = time.process_time()
        if self.connector == "nixl":  # the sender knows when its WRITEs are DONE (flushed)
            self.child.start("raw", frames=frames)
            reply = self.child.wait()
            return Run(reply["t_done"] - reply["t0"], time.process_time() - cpu0 + reply["cpu"])
        if self.connector == "nccl":
            import torch.distributed as dist

            views = [landing[layer][start : start + n] for layer, start, n in frames]
            works = [dist.irecv(v, src=0, tag=i) for i, v in enumerate(views)]
            self.child.start("raw", frames=frames)
            for work in works:
                work.wait()
            sync(self.device)
        else:
            assert self.pull is not None
            self.child.start("raw", frames=frames)
            while self.pull.poll(int(OP_TIMEOUT_S * 1000)):
                if len(self.pull.recv(copy=False).buffer) == 0:
                    break
        t_end, cpu = time.monotonic(), time.process_time() - cpu0
        reply = self.child.wait()
        return Run(t_end - reply["t0"], cpu + reply["cpu"])

    def run_point(self, point: Point, repeats: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(point.tokens)
        src = torch.randperm(point.n_blocks, generator=gen).tolist()
        dst = torch.randperm(point.n_blocks, generator=gen).tolist()
        shape, dtype = point.layout.page_shape(point.n_blocks), getattr(torch, point.layout.dtype)
        layers = range(point.layout.num_layers)
        caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in layers]
        opts = {"staging_bytes": SHM_STAGING_BYTES} if point.connector == "shm" else {}
        self.receiver = create_receiver(point.connector, point.layout, caches, **opts)
        self.receiver_layers = point.layout.num_layers
        try:
            target = {}
            if point.connector == "nixl":
                from pdserve.kv_transfer.nixl_agent import describe_caches

                target = describe_caches(caches)
                target["agent"] = target["agent"].hex()  # the child's commands are JSON
            endpoint = self.receiver.endpoint
            layout = point.layout.to_dict()
            self.child.call(
                "point",
                self.pump,
                layout=layout,
                src=src,
                dst=dst,
                endpoint=endpoint,
                target=target,
            )
            landing = [as_bytes(c) for c in caches]
            if point.connector == "shm":  # memcpy source: a second copy of the bytes
                landing = [torch.ones_like(b) for b in landing] + landing
            return self._measure(point, dst, landing, repeats)
        finally:
            self.receiver.close()
            self.receiver = None

    def _measure(
        self, point: Point, dst: list[int], landing: list[torch.Tensor], repeats: int
    ) -> dict[str, Any]:
        layers = list(range(point.layout.num_layers))
        whole, layer = Samples(), Samples()
        calls, tails, oks = [], [], []
        self.transfer(dst, layers)  # warm-up: first touch, connection setup
        self.raw(point, layers, landing)
        for _ in range(repeats):
            run = self.transfer(dst, layers)
            whole.conn.append(run["run"])
            calls += run["calls"]
            tails.append(run["tail"])
            whole.raw.append(self.raw(point, layers, landing))
            one = self.transfer(dst, [0])
            layer.conn.append(one["run"])
            layer.raw.append(self.raw(point, [0], landing))
            oks += [(run["ok"], run["error"]), (one["ok"], one["error"])]
        frames = point.frames([0])
        return {
            "connector": point.connector,
            "layout": point.layout_name,
            "tokens": point.tokens,
            "n_blocks": point.n_blocks,
            "bytes": point.nbytes,
            "layer_bytes": point.layer_bytes,
            "frames_per_layer": len(frames),
            "frame_bytes": frames[0][2],
            "ok": all(ok for ok, _ in oks),
            "errors": sorted({error for ok, error in oks if not ok}),
            "whole": whole.summary(point.nbytes),
            "layer": layer.summary(point.layer_bytes),
            "send_layer_ms": statistics.median(calls) * 1e3,
            "tail_ms": statistics.median(tails) * 1e3,
            "goal": GOALS[point.connector],
        }

    def close(self) -> None:
        try:
            self.child.close()
        finally:
            if self.pull is not None:
                self.pull.close(linger=0)
            if self.connector == "nccl":
                close_raw_group()


def memcpy_frames(frames: list[tuple[int, int, int]], bufs: list[torch.Tensor], device: str) -> Run:
    """`copy_` of each frame from the first half of `bufs` (sources) into the second half."""
    half = len(bufs) // 2
    sync(device)
    cpu0, t0 = time.process_time(), time.monotonic()
    for layer, start, n in frames:
        bufs[half + layer][start : start + n].copy_(bufs[layer][start : start + n])
    sync(device)
    return Run(time.monotonic() - t0, time.process_time() - cpu0)


def stage_costs(point: Point, device: str) -> dict[str, float]:
    """GB/s of each pass a connector adds over its transport, on one layer of `point`.

    Best of a few runs, so buffers are reused and page faults do not show here (they do in
    the transfers). For comparison: `crc32` is the checksum `page_checksum` replaced, and
    `index_copy_ rows` the scatter's `index_copy_` on a [2 * blocks, block] view.
    """
    layout, n = point.layout, point.n_blocks
    cache = torch.rand(layout.page_shape(n)).to(getattr(torch, layout.dtype)).to(device)
    ids = torch.randperm(n, device=device)
    pages = ops.gather_pages(cache, ids)
    fns: dict[str, Callable[[], object]] = {
        "gather_pages": lambda: ops.gather_pages(cache, ids),
        "gather_pages out=": lambda: ops.gather_pages(cache, ids, out=pages),
        "scatter_pages": lambda: ops.scatter_pages(cache, ids, pages),
        "copy_": lambda: cache.copy_(pages),
        "page_checksum": lambda: page_checksum(pages).tolist(),
    }
    rows, block_rows = cache.view(2 * n, -1), pages.view(2 * n, -1)
    row_ids = torch.cat([ids, ids + n])
    fns["index_copy_ rows"] = lambda: rows.index_copy_(0, row_ids, block_rows)
    if device == "cpu":
        fns["crc32"] = lambda: zlib.crc32(as_bytes(pages).numpy())
    return {name: point.layer_bytes / best_time(fn, device) / 1e9 for name, fn in fns.items()}


# -- report -------------------------------------------------------------------------------------


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per connector: the whole-transfer ratio at its largest point and how many points meet
    the goal."""
    out: dict[str, Any] = {}
    for connector in CONNECTORS:
        mine = [r for r in results if r["connector"] == connector]
        if not mine:
            continue
        largest = max(mine, key=lambda r: (r["bytes"], r["tokens"]))
        ratios = [r["whole"]["ratio"] for r in mine]
        out[connector] = {
            "goal": GOALS[connector],
            "largest": f"{largest['layout']} {fmt_tokens(largest['tokens'])} tokens",
            "ratio_at_largest": largest["whole"]["ratio"],
            "gb_s_at_largest": largest["whole"]["gb_s"],
            "raw_gb_s_at_largest": largest["whole"]["raw_gb_s"],
            "median_ratio": statistics.median(ratios),
            "points_meeting_goal": sum(r >= GOALS[connector] for r in ratios),
            "points": len(mine),
        }
    return out


# The passes over the bytes each connector makes beyond its raw transport (shm's raw copy is
# its gather into the ring; nixl writes in place, over runs of blocks: no gather or scatter).
EXTRA_PASSES = {
    "zmq": ("gather_pages out=", "page_checksum", "page_checksum", "scatter_pages"),
    "nccl": ("gather_pages out=", "page_checksum", "page_checksum", "scatter_pages"),
    "shm": ("page_checksum", "page_checksum", "scatter_pages"),
    "nixl": ("page_checksum", "page_checksum"),
}


def pass_model(report: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per connector at its largest point: (predicted, measured) ratio, where predicted =
    raw s/GB / (raw s/GB + the extra passes' s/GB at this run's single-pass rates), as if
    every pass ran one after another."""
    gb_s = report.get("stages", {}).get("gb_s", {})
    out: dict[str, tuple[float, float]] = {}
    for connector, summary in report["summary"].items():
        passes = EXTRA_PASSES.get(connector, ())
        if not passes or not all(gb_s.get(p) for p in passes):
            continue
        raw = 1 / summary["raw_gb_s_at_largest"]
        extra = sum(1 / gb_s[p] for p in passes)
        out[connector] = (raw / (raw + extra), summary["ratio_at_largest"])
    return out


def connector_tables(report: dict[str, Any]) -> list[str]:
    """The goals at each connector's largest point, then each connector across its points."""
    model = pass_model(report)
    summary = {c: report["summary"][c] for c in CONNECTORS if c in report["summary"]}
    goals = [
        goal(
            f"{c} >= {s['goal']} x raw {RAW_NAMES[c]} GB/s ({s['largest']})",
            s["gb_s_at_largest"],
            s["raw_gb_s_at_largest"],
            ">=",
            s["goal"],
        )
        for c, s in summary.items()
    ]
    intact = sum(r["ok"] for r in report["results"])
    goals.append(goal("every transfer intact", intact, len(report["results"]), ">=", 1.0))
    header = ["connector", "points meeting its goal", "median ratio"]
    header += ["serial pass model at the largest point (measured)"]
    rows = [
        [c, f"{s['points_meeting_goal']} of {s['points']}", s["median_ratio"]]
        + [f"{model[c][0]:.2f} ({model[c][1]:.2f})" if c in model else "—"]
        for c, s in summary.items()
    ]
    return [goals_table(goals), "", markdown_table(header, rows)]


COLUMNS = [
    ("layout", "layout"),
    ("tokens", lambda r: fmt_tokens(r["tokens"])),
    ("MiB", lambda r: r["bytes"] / 2**20),
    ("connector", "connector"),
    *[(header, lambda r, k=key: r["whole"][k]) for header, key in
      (("whole ms", "ms"), ("GB/s", "gb_s"), ("raw GB/s", "raw_gb_s"), ("ratio", "ratio"))],
    ("CPU s/GB (raw)", lambda r: f"{r['whole']['cpu_s_per_gb']:.2f} "
     f"({r['whole']['raw_cpu_s_per_gb']:.2f})"),
    ("layer ms", lambda r: r["layer"]["ms"]),
    ("layer ratio", lambda r: r["layer"]["ratio"]),
    ("send_layer ms", "send_layer_ms"),
    ("tail ms", "tail_ms"),
]  # fmt: skip


def section(report: dict[str, Any], figure: str) -> str:
    """The benchmarks.md section; `figure` is the plot's path as the page links it."""
    results = sorted(report["results"], key=lambda r: (r["layout"], r["tokens"], r["connector"]))
    lines = ["## KV transfer: connectors against their raw transport", ""]
    lines += [*run_header(report, "torch threads per process"), ""]
    lines += [records_table(COLUMNS, results), "", f"![KV transfer GB/s]({figure})", ""]
    lines += connector_tables(report)
    if report["skipped"]:
        lines += ["", "Skipped points:", "", skipped_table(report["skipped"])]
    if report.get("stages"):
        stages = report["stages"]
        lines += ["", f"Single-pass GB/s on one layer of {stages['point']} (one thread):", ""]
        lines += [markdown_table(list(stages["gb_s"]), [list(stages["gb_s"].values())])]
    return "\n".join(lines)


def skipped_table(skipped: list[dict[str, Any]]) -> str:
    """One row per skipped (layout, tokens, reason), naming the connectors it applies to."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    for s in skipped:
        groups.setdefault((s["layout"], s["tokens"], s["reason"]), []).append(s["connector"])
    rows = [
        [layout, fmt_tokens(tokens), ", ".join(connectors), reason]
        for (layout, tokens, reason), connectors in groups.items()
    ]
    return markdown_table(["layout", "tokens", "connectors", "reason"], rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    layouts = sorted({r["layout"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.2), squeeze=False)
    for ax, name in zip(axes[0], layouts):
        mine = sorted(
            (r for r in report["results"] if r["layout"] == name), key=lambda r: r["tokens"]
        )
        for i, connector in enumerate(CONNECTORS):
            rows = [r for r in mine if r["connector"] == connector]
            x = [r["tokens"] for r in rows]
            if rows:
                ax.plot(x, [r["whole"]["gb_s"] for r in rows], "o-", color=f"C{i}", label=connector)
                ax.plot(
                    x,
                    [r["whole"]["raw_gb_s"] for r in rows],
                    "s--",
                    color=f"C{i}",
                    label=f"raw {RAW_NAMES[connector]}",
                    alpha=0.7,
                )
        ticks = sorted({r["tokens"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [fmt_tokens(t) for t in ticks])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("GB/s (whole transfer)")
        ax.set_title(f"{name} layout ({report['layouts'][name]['dtype']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


# -- CLI ----------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """`2G`, `512M`, `1.5GiB`, `4096` -> bytes (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def parse_tokens(text: str) -> list[int]:
    """`128,2k,32k` -> [128, 2048, 32768]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"bad token list {text!r}")
    return out


RUN_FLAGS = [
    ("--quick", bool, None, "tiny layout, 128 and 512 tokens, 2 repeats: seconds (needs --out)"),
    ("--connectors", str, ",".join(CONNECTORS), "connectors to measure, a comma list"),
    ("--layouts", str, None, "KV layouts, a comma list of tiny and llama3-8b (default: both; "
     "quick: tiny)"),
    ("--tokens", parse_tokens, None, "prompt lengths in tokens, a comma list, k = 1024 (default: "
     "128,512,2k,4k,8k,32k; quick: 128,512)", {"metavar": "N,N,..."}),
    ("--repeats", int, None, "timed transfers per point, the median reported (default: 5; "
     "quick: 2)"),
    ("--max-bytes", parse_size, parse_size("512M"), "skip points whose KV bytes (one side) "
     "exceed this, binary units: 512M, 2G (default: 512M)", {"metavar": "SIZE"}),
    ("--no-stages", bool, None, "skip the per-pass timings (gather, checksum)"),
]  # fmt: skip
DEVICE_FLAGS = [
    ("--device", str, "cpu", "where the KV is", {"choices": ("cpu", "cuda")}),
    ("--threads", int, 1, "torch threads per process on CPU (1: two processes on two cores)"),
]


def make_parser() -> argparse.ArgumentParser:
    p = parser("pdserve bench kv-transfer", __doc__.split("\n\n")[0])
    add_flags(p.add_argument_group("run"), RUN_FLAGS)
    add_flags(p.add_argument_group("device"), DEVICE_FLAGS)
    output = add_output_flags(p, "kv_transfer.json and kv_transfer.png")
    add_from_json_flag(output, "the figure and section of a saved kv_transfer.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.child:
        return args
    args.outputs = outputs_from_args(p, args)
    args.connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    if not args.connectors or set(args.connectors) - set(CONNECTORS):
        p.error(f"--connectors must name some of {CONNECTORS}")
    args.layouts = (args.layouts or ("tiny" if args.quick else ",".join(LAYOUTS))).split(",")
    if set(args.layouts) - set(LAYOUTS):
        p.error(f"--layouts must name some of {LAYOUTS}")
    args.tokens = args.tokens or list(QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    layouts = {n: lay for n, lay in make_layouts(args.device).items() if n in args.layouts}
    points, skipped = plan(args, layouts)
    results = []
    for connector in args.connectors:
        mine = [p for p in points if p.connector == connector]
        results += run_connector(connector, mine, args.repeats, args.device) if mine else []
    per_token = {n: lay.page_bytes * lay.num_layers // lay.block_size for n, lay in layouts.items()}
    report = {
        "device": args.device,
        "repeats": args.repeats,
        "max_bytes": args.max_bytes,
        "goals": GOALS,
        "raw": RAW_NAMES,
        "layouts": {
            n: {**lay.to_dict(), "bytes_per_token": per_token[n]} for n, lay in layouts.items()
        },
        "results": results,
        "skipped": skipped,
        "summary": summarize(results),
    }
    if not args.no_stages and points:
        largest = max(points, key=lambda p: p.nbytes)
        report["stages"] = {
            "point": f"{largest.layout_name} {fmt_tokens(largest.tokens)} tokens",
            "layer_bytes": largest.layer_bytes,
            "gb_s": stage_costs(largest, args.device),
        }
    return report


def run_connector(connector: str, points: list[Point], repeats: int, device: str) -> list[dict]:
    bench = Bench(connector, device)
    try:
        results = []
        for point in points:
            results.append(bench.run_point(point, repeats))
            print(record_line([*COLUMNS[:8], ("intact", "ok")], results[-1]), flush=True)
        return results
    finally:
        bench.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.child:
        child_main(args.child, args.device)
        return 0
    script = "bench_kv_transfer.py"
    report = measure_or_load(args, "kv_transfer", script, argv, lambda: measure(args))
    for s in report["skipped"]:
        print(f"skipped {s['connector']} {s['layout']} {fmt_tokens(s['tokens'])}: {s['reason']}")
    publish("kv_transfer", report, args.outputs, plot, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

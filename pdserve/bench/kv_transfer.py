"""KV transfer: each connector against its raw transport, sender and receiver in two processes.

    pdserve bench kv-transfer                       # docs/bench + docs/benchmarks.md
    pdserve bench kv-transfer --quick --out DIR     # seconds; what the tests run
    python scripts/bench_kv_transfer.py ...         # the same, as the docs cite it

For every connector (`zmq`, `nccl`, `shm`), layout (`tiny`: the geometry of
pdserve.tiny_model's default model; `llama3-8b`: 32 layers, 8 KV heads, head_dim 128; block
size 16; float32 on CPU, bfloat16 on CUDA) and prompt length N, the receiver lives in this
process with a cache of exactly the N tokens' blocks, and a child process (this module with
`--child`) holds the sender's cache. Source and destination block ids are random
permutations, as a real block table's would be. Both processes read the same clock
(CLOCK_MONOTONIC), so a start taken in the child and an end taken here measure one span.

What is timed (median of `--repeats`, after one untimed warm-up; GB = 1e9 bytes):

- **whole**: `send_layer` for every layer back to back, then `send_done`; from just before the
  first `send_layer` (child) until this process's `poll` returns the `TransferResult`.
  GB/s = all layers' KV bytes / that time.
- **layer**: one layer's pages as a transfer of its own (`send_layer` + `send_done`), timed
  the same way: the latency of one layer of a layer-by-layer pipelined send.
- **send_layer_ms**: how long one `send_layer` call blocks the sender (what a prefill forward
  pays per layer before it can go on), median over the layers of the whole runs.
- **tail_ms**: from the return of the last `send_layer` to the result: the part of a
  layer-wise pipelined transfer that no compute can hide.
- **raw**: the same bytes in the same frame sizes over the bare transport, interleaved with
  the connector's repeats: plain pyzmq PUSH/PULL (`zmq`), plain torch.distributed
  isend/irecv (`nccl`: gloo on CPU, NCCL on CUDA) into the receiver's cache, one `copy_` per
  frame (`shm`). The headline is connector GB/s / raw GB/s (the `ratio`), against the goals
  zmq >= 0.9, nccl >= 0.9, shm >= 0.7.

Points whose KV bytes exceed `--max-bytes` are skipped and listed with the reason; at peak
each process may hold up to about four times a point's KV bytes (its cache, frames in flight
in both the connector and the transport, the raw baseline's buffers). `stages` times, in this
process, the passes a connector adds over its transport (gather, checksum, scatter) on one layer
of the largest point, so a missed goal can be read against them. CPU seconds of both
processes are recorded next to wall time: on a shared machine they move less.
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
    add_output_flags,
    best_time,
    command_line,
    describe_machine,
    machine,
    markdown_table,
    outputs_from_args,
    publish,
    pyplot,
    save_figure,
    sync,
)
from pdserve.common.node.cli import parser
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
    connectors: Sequence[str],
    layouts: dict[str, KVLayout],
    tokens: Sequence[int],
    max_bytes: int,
    device: str,
) -> tuple[list[Point], list[dict[str, Any]]]:
    """The points to run and, for the others, why not."""
    points, skipped = [], []
    for connector in connectors:
        for name, layout in layouts.items():
            for n in tokens:
                point = Point(connector, name, layout, n)
                reason = skip_reason(point, max_bytes, device)
                if reason:
                    skipped.append(
                        {
                            "connector": connector,
                            "layout": name,
                            "tokens": n,
                            "bytes": point.nbytes,
                            "reason": reason,
                        }
                    )
                else:
                    points.append(point)
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
    """The child's state: caches of the current point, a connector sender, a raw transport."""

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

    def point(self, layout: dict[str, Any], src: list[int], dst: list[int]) -> dict[str, Any]:
        self.caches, self.host_bytes = [], []  # free the last point's tensors first
        kv = KVLayout.from_dict(layout)
        gen = torch.Generator().manual_seed(SEED)
        shape = kv.page_shape(len(src))
        self.caches = [
            torch.rand(shape, generator=gen).to(getattr(torch, kv.dtype)).to(self.device)
            for _ in range(kv.num_layers)
        ]
        if self.connector == "zmq" and self.device != "cpu":
            self.host_bytes = [as_bytes(c.cpu()) for c in self.caches]
        self.src, self.dst = src, dst
        return {}

    def connect(self, layout: dict[str, Any], endpoint: str) -> dict[str, Any]:
        if self.sender is not None:
            self.sender.close()
        self.sender = create_sender(self.connector, KVLayout.from_dict(layout))
        self.sender.connect(endpoint, timeout=60.0)
        return {}

    def send(self, xfer: str, layers: list[int]) -> dict[str, Any]:
        calls = []
        cpu0, t0 = time.process_time(), time.monotonic()
        for layer in layers:
            start = time.monotonic()
            self.sender.send_layer(xfer, layer, self.src, self.dst, self.caches[layer])
            calls.append(time.monotonic() - start)
        t_layers = time.monotonic()
        self.sender.send_done(xfer, {"n_tokens": len(self.src)})
        self.sender.flush(OP_TIMEOUT_S)
        cpu = time.process_time() - cpu0
        return {"t0": t0, "t_layers": t_layers, "calls": calls, "cpu": cpu}

    def raw_setup(self, endpoint: str = "", store_port: int = 0) -> dict[str, Any]:
        if self.connector == "zmq":
            self.push = zmq.Context.instance().socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 0)
            self.push.connect(endpoint)
        elif self.connector == "nccl":
            init_raw_group(rank=0, store_port=store_port, device=self.device)
        return {}

    def raw_nixl(self, target: dict[str, Any]) -> dict[str, Any]:
        """The receiver's caches as the raw NIXL baseline's target (one per point)."""
        from pdserve.kv_transfer.nixl_agent import Agent, remote_pages

        if self.nixl_target is not None:
            Agent.get().drop_remote(self.nixl_target[0])
        name, pages = remote_pages({**target, "agent": bytes.fromhex(target["agent"])})
        self.nixl_target = (name, pages, int(target["num_blocks"]))
        return {}

    def raw(self, frames: list[list[int]]) -> dict[str, Any]:
        if self.connector == "nixl":  # the connector's WRITEs, bare: same descriptors
            from pdserve.kv_transfer.nixl_agent import wait_handles, write_pages

            assert self.nixl_target is not None
            _, pages, blocks = self.nixl_target
            layers = sorted({f[0] for f in frames})
            cpu0, t0 = time.process_time(), time.monotonic()
            handles = write_pages(self.caches, pages, blocks, layers, self.src, self.dst)
            wait_handles(handles, OP_TIMEOUT_S)
            t_done = time.monotonic()
            return {"t0": t0, "t_done": t_done, "cpu": time.process_time() - cpu0}
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

    def close(self) -> dict[str, Any]:
        if self.sender is not None:
            self.sender.close()
        if self.push is not None:
            self.push.close(linger=0)
        if self.connector == "nccl":
            close_raw_group()
        return {}


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
            reply = {"ok": True, **getattr(state, op)(**cmd)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        if op == "close":
            break


class Child:
    """The sender process seen from here; `wait` keeps `idle` (the receiver's poll) running."""

    def __init__(self, connector: str, device: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.bench.kv_transfer",
                "--child",
                connector,
                "--device",
                device,
                "--threads",
                str(torch.get_num_threads()),
            ],
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

    def wait(self, idle: Callable[[], None] | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + OP_TIMEOUT_S
        while True:
            try:
                reply = self._replies.get(timeout=0 if idle else 0.01)
                if not reply["ok"]:
                    raise RuntimeError(f"sender child: {reply['error']}")
                return reply
            except queue.Empty:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sender child died or hung (exit {self.proc.returncode})")
            if idle:
                idle()

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
                self.proc.wait()


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
        deadline = time.monotonic() + OP_TIMEOUT_S
        while xfer not in self.results:
            assert time.monotonic() < deadline, f"transfer {xfer} did not finish"
            self.pump()
        sync(self.device)
        t_end, cpu = time.monotonic(), time.process_time() - cpu0
        reply = self.child.wait(self.pump)
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
        caches = [
            torch.zeros(
                point.layout.page_shape(point.n_blocks),
                dtype=dtype_of(point.layout),
                device=self.device,
            )
            for _ in range(point.layout.num_layers)
        ]
        opts = {"staging_bytes": SHM_STAGING_BYTES} if point.connector == "shm" else {}
        self.receiver = create_receiver(point.connector, point.layout, caches, **opts)
        self.receiver_layers = point.layout.num_layers
        try:
            self.child.call("point", layout=point.layout.to_dict(), src=src, dst=dst)
            self.child.call(
                "connect", self.pump, layout=point.layout.to_dict(), endpoint=self.receiver.endpoint
            )
            if point.connector == "nixl":
                from pdserve.kv_transfer.nixl_agent import describe_caches

                target = describe_caches(caches)
                target["agent"] = target["agent"].hex()  # the child's commands are JSON
                self.child.call("raw_nixl", target=target)
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


def dtype_of(layout: KVLayout) -> torch.dtype:
    return getattr(torch, layout.dtype)


# -- per-pass costs -----------------------------------------------------------------------------


def stage_costs(point: Point, device: str) -> dict[str, float]:
    """GB/s of each pass a connector adds over its transport, on one layer of `point`.

    Best of a few runs, so buffers are reused and page faults do not show here (they do in
    the transfers). For comparison: `crc32` is the checksum `page_checksum` replaced, and
    `index_copy_ rows` the scatter's `index_copy_` on a [2 * blocks, block] view.
    """
    layout, n = point.layout, point.n_blocks
    cache = torch.rand(layout.page_shape(n)).to(dtype_of(layout)).to(device)
    ids = torch.randperm(n, device=device)
    pages = ops.gather_pages(cache, ids)
    nbytes = point.layer_bytes
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
    return {name: nbytes / best_time(fn, device) / 1e9 for name, fn in fns.items()}


# -- report -------------------------------------------------------------------------------------

# What changed and what profiling found (perf and cProfile of both processes, llama3-8b
# layout, 2k tokens, this 2-core machine); kept here so the doc section states it next to the
# numbers that show it.
WHY_MISSED = """\
What changed: before it, this section showed at llama3-8b 2k zmq 0.31, nccl 0.24, shm 0.10
x raw (0.51, 0.54, 0.73 GB/s). Same-session steps, each measured with
`python scripts/bench_kv_transfer.py --layouts llama3-8b --tokens 2k --repeats 3 --out DIR`
(ratio, CPU s/GB): before, zmq 0.24 / 1.63, nccl 0.19 / 1.81, shm 0.11 / 0.94;

- **checksum** (`kv_transfer/wire.py: page_checksum`): crc32 is replaced by
  `pdserve-rowcol64/1`, int64 sums of the frame's rows and columns weighted by position (any
  changed byte changes the plain sum; moved words change a weighted one), exact integer
  arithmetic, so CPU and CUDA ends compute the same value. Receivers name it in their welcome
  and senders in their done message, so ends of different versions are refused (sender:
  TransferError at connect; receiver: the transfer fails naming both schemes). It ran at two
  to three times crc32's speed (single-pass line above): zmq 0.32 / 1.17, nccl 0.23 / 1.67,
  shm 0.15 / 0.73.
- **frames of at most 8 MiB** (`FRAME_BYTES`, whole pages): no more fresh mappings per
  frame, and frames pipeline; **shm gathers straight into its ring slot** (one pass fewer):
  zmq 0.42, nccl 0.35, shm 0.24.
- **reused buffers**: the zmq sender gathers into four buffers, each lent until zmq's tracker
  says the frame left (a fresh one when all are out, so a slow receiver never blocks it); the
  gloo sender keeps at most four sends in flight (was 64 fresh gathers) in reused buffers,
  and the gloo receiver receives into reused buffers (this step also widened the checksum's
  rows to 1000 words, which sums faster): zmq 0.53, nccl 0.45, shm 0.23.

Why the goals are still missed: on two shared cores the transfer is CPU bound, so the ratio
follows the raw transport's CPU per GB over the connector's (the CPU s/GB column), and
each connector still makes four passes over the bytes that the raw transport does not: the
sender's gather and checksum, the receiver's checksum and scatter. The serial pass model above
is the ratio if those passes ran one after another; the measured ratio sits above it by as
much as the two processes' passes overlap on the two cores, and the two together bracket
where the time goes (in an earlier run, with faster single-pass rates, the model gave zmq
0.46 against 0.45 measured). Reaching 0.9 x raw pyzmq would leave under a tenth of the raw
transport's time for all four passes, less than half of one pass at this machine's memory
speed: on CPU the goals need passes removed, not made faster (sending pages straight from
the cache when a layer's blocks are contiguous, receiving into reserved blocks, a checksum
fused into the copy), and verifying every page is a pass pdserve keeps. On a GPU the same
passes run in HBM at terabytes per second against a link of tens of GB/s, so they weigh
little there.

- **scatter** (`kernels/reference.py: scatter_pages_ref`, `index_copy_`) is the largest
  single cost on every receiver (perf: about a quarter of the shm samples, a tenth of zmq's).
  On a `[2 * num_blocks, block]` view of the cache (`index_copy_ rows` above) it was faster
  in one trial and not in this run: no change made.
- **shm** is compared with one `copy_`; gather + two checksums + scatter cannot reach 0.7 of
  it on CPU while the receiver verifies every page (perf: its checksum, reading the ring the
  other process wrote, costs more than the sender's).
- **small pages** (tiny layout, 4 KiB pages: up to 2048 block ids per frame): per-id Python
  work dominated, the strict header decoder (`common/protocol.py: _check`) checking every
  block id with a recursive call, the largest cost in the receiver's cProfile. Lists of plain
  ints or strings now pass with one type test per element (2048 ids: about 0.13 ms).
- **CUDA** paths (the checksum on device, gathers into a CUDA ring, NCCL frames of 8 MiB) were
  not measured: no GPU here.
"""


NIXL_NOTE = """\
**nixl** writes each layer's pages from the sender's cache blocks straight into the
receiver's reserved blocks (one NIXL WRITE per layer, runs of contiguous blocks merged into
one descriptor): no gather, staging or scatter, so the passes it adds to its raw transport are
the two checksums, one on each end (`kv_transfer/nixl_wire.py`). The sender sums each
layer's pages right after posting its WRITE; each WRITE carries a NIXL notification, which
arrives after its data, and the receiver sums that layer's pages while later layers still
travel, so little is left for the tail. Measured steps at llama3-8b 2k (`--connectors nixl
--layouts llama3-8b --tokens 2k`): the first version checksummed every page with a row- and
column-weighted sum per run of blocks after the last layer, on both ends one after the other:
0.22 x raw, tail 1 s; per-page word sums (one reduction, the column pass dropped: a DMA
moves whole descriptors, so a page's words cannot swap) summed per layer as it lands: 0.75,
tail 25 ms. Moving the sender's sums to a worker thread changed nothing (0.72) and was
dropped. NIXL's own progress thread spins without a pause and took one of the two cores
from everything else: without it (the receiver reads notifications every half millisecond
on a thread of its own, which is what moves UCX's large WRITEs; a sender progresses in its
own calls) nixl went from 1.2 to 2.3 GB/s and its raw baseline from 1.8 to 3.4 GB/s, at a
ratio of 0.67 to 0.71 (runs vary). What is left is memory traffic: here UCX moves the bytes
with a shared-memory copy (its CMA/shm transports; the raw WRITE is that copy), and the two
checksums read every byte twice more on the same two cores and memory, so on this machine
the goal of 0.9 is not met.
Over RDMA or NVLink the link, not the memory, is the bottleneck, and the sums (in HBM on
CUDA) weigh little; that run needs a GPU machine."""


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


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def section(report: dict[str, Any], figure: str) -> str:
    """The benchmarks.md section; `figure` is the plot's path as the page links it."""
    header = [
        "layout",
        "tokens",
        "MiB",
        "connector",
        "whole ms",
        "GB/s",
        "raw GB/s",
        "ratio",
        "CPU s/GB (raw)",
        "layer ms",
        "layer ratio",
        "send_layer ms",
        "tail ms",
    ]
    rows = [
        [
            r["layout"],
            fmt_tokens(r["tokens"]),
            r["bytes"] / 2**20,
            r["connector"],
            r["whole"]["ms"],
            r["whole"]["gb_s"],
            r["whole"]["raw_gb_s"],
            r["whole"]["ratio"],
            f"{r['whole']['cpu_s_per_gb']:.2f} ({r['whole']['raw_cpu_s_per_gb']:.2f})",
            r["layer"]["ms"],
            r["layer"]["ratio"],
            r["send_layer_ms"],
            r["tail_ms"],
        ]
        for r in sorted(report["results"], key=lambda r: (r["layout"], r["tokens"], r["connector"]))
    ]
    lines = [
        "## KV transfer: connectors against their raw transport",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {describe_machine(report['machine'], 'torch threads per process')}; "
        f"device `{report['device']}`; "
        f"median of {report['repeats']} repeats; load average {report['load_avg'][0]:.1f} "
        f"at start, {report['load_avg'][1]:.1f} at end (other work shared the cores).",
        "",
        "**whole** = every layer's `send_layer`, then `send_done`, from the sender's first call "
        "until the receiver's `poll` returns the result; **layer** = one layer sent as a "
        "transfer of its own; **ratio** = connector GB/s / raw GB/s for the same bytes in the "
        f"same frame sizes (raw: zmq = {RAW_NAMES['zmq']}, nccl = {RAW_NAMES['nccl']}, shm = "
        f"{RAW_NAMES['shm']} per frame, nixl = {RAW_NAMES['nixl']} of the same descriptors, "
        "one per layer, timed until the sender sees them done); **CPU s/GB** = CPU seconds "
        "of both processes per GB "
        "moved, which other load on the machine disturbs less than wall time; **send_layer ms** "
        "= how long one call blocks the sender; **tail ms** = from the last `send_layer` "
        "return to the result. GB = 1e9 bytes. Definitions in `pdserve/bench/kv_transfer.py`.",
        "",
        markdown_table(header, rows),
        "",
        f"![KV transfer GB/s]({figure})",
        "",
        *goal_lines(report),
    ]
    if report["skipped"]:
        lines += ["", "Skipped points:", "", *skipped_lines(report["skipped"])]
    if report.get("stages"):
        stages = ", ".join(f"{k} {v:.2f}" for k, v in report["stages"]["gb_s"].items())
        lines += [
            "",
            f"Single-pass GB/s on one layer of {report['stages']['point']} (one "
            f"thread, this process): {stages}.",
        ]
    model = pass_model_line(report)
    if model:
        lines += ["", model]
    if any(s["ratio_at_largest"] < s["goal"] for s in report["summary"].values()):
        lines += ["", WHY_MISSED]
    if "nixl" in report["summary"]:
        lines += ["", NIXL_NOTE]
    return "\n".join(lines)


# The passes over the bytes each connector makes beyond its raw transport (shm's raw copy is
# its gather into the ring).
EXTRA_PASSES = {
    "zmq": ("gather_pages out=", "page_checksum", "page_checksum", "scatter_pages"),
    "nccl": ("gather_pages out=", "page_checksum", "page_checksum", "scatter_pages"),
    "shm": ("page_checksum", "page_checksum", "scatter_pages"),
    "nixl": ("page_checksum", "page_checksum"),  # in place, over runs of blocks: no gather
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


def pass_model_line(report: dict[str, Any]) -> str:
    model = pass_model(report)
    if not model:
        return ""
    parts = ", ".join(f"{c} {pred:.2f} (measured {got:.2f})" for c, (pred, got) in model.items())
    return (
        "Serial pass model at the largest point, from this run's single-pass rates (a floor: "
        "it lets no pass overlap another): ratio = "
        "raw s/GB / (raw s/GB + s/GB of the connector's extra passes: gather, checksum on "
        f"each end, scatter; shm's gather is its copy): {parts}."
    )


def skipped_lines(skipped: list[dict[str, Any]]) -> list[str]:
    """One line per skipped (layout, tokens, reason), naming the connectors it applies to."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    for s in skipped:
        groups.setdefault((s["layout"], s["tokens"], s["reason"]), []).append(s["connector"])
    return [
        f"- {layout} {fmt_tokens(tokens)} ({', '.join(connectors)}): {reason}"
        for (layout, tokens, reason), connectors in groups.items()
    ]


def goal_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "Goals (whole transfer): zmq >= 0.9 x raw pyzmq, nccl >= 0.9 x raw "
        "torch.distributed, shm >= 0.7 x memcpy.",
        "",
    ]
    for connector, s in report["summary"].items():
        verdict = "meets" if s["ratio_at_largest"] >= s["goal"] else "**misses**"
        lines.append(
            f"- {connector}: {verdict} its goal at the largest point ({s['largest']}): "
            f"{s['ratio_at_largest']:.2f} x raw ({s['gb_s_at_largest']:.2f} vs "
            f"{s['raw_gb_s_at_largest']:.2f} GB/s); {s['points_meeting_goal']} of "
            f"{s['points']} points meet {s['goal']}."
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    layouts = sorted({r["layout"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.2), squeeze=False)
    for ax, name in zip(axes[0], layouts):
        for i, connector in enumerate(CONNECTORS):
            rows = sorted(
                (
                    r
                    for r in report["results"]
                    if r["layout"] == name and r["connector"] == connector
                ),
                key=lambda r: r["tokens"],
            )
            if not rows:
                continue
            x = [r["tokens"] for r in rows]
            color = f"C{i}"
            ax.plot(x, [r["whole"]["gb_s"] for r in rows], "o-", color=color, label=connector)
            ax.plot(
                x,
                [r["whole"]["raw_gb_s"] for r in rows],
                "s--",
                color=color,
                label=f"raw {RAW_NAMES[connector]}",
                alpha=0.7,
            )
        ticks = sorted({r["tokens"] for r in report["results"] if r["layout"] == name})
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser("pdserve bench kv-transfer", __doc__.split("\n\n")[0])
    run = p.add_argument_group("run")
    run.add_argument(
        "--quick",
        action="store_true",
        help="tiny layout, 128 and 512 tokens, 2 repeats: seconds (needs --out)",
    )
    run.add_argument(
        "--connectors",
        default=",".join(CONNECTORS),
        metavar="NAME,...",
        help="connectors to measure, a comma list",
    )
    run.add_argument(
        "--layouts",
        default=None,
        metavar="NAME,...",
        help="KV layouts, a comma list of tiny and llama3-8b (default: both; quick: tiny)",
    )
    run.add_argument(
        "--tokens",
        type=parse_tokens,
        default=None,
        metavar="N,N,...",
        help="prompt lengths in tokens, a comma list, k = 1024 (default: 128,512,2k,4k,8k,32k; "
        "quick: 128,512)",
    )
    run.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed transfers per point, the median reported (default: 5; quick: 2)",
    )
    run.add_argument(
        "--max-bytes",
        type=parse_size,
        default=parse_size("512M"),
        metavar="SIZE",
        help="skip points whose KV bytes (one side) exceed this, binary units: 512M, 2G "
        "(default: 512M)",
    )
    run.add_argument(
        "--no-stages", action="store_true", help="skip the per-pass timings (gather, checksum)"
    )
    device = p.add_argument_group("device")
    device.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the KV is")
    device.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process on CPU (1: two processes on two cores)",
    )
    add_output_flags(p, "kv_transfer.json and kv_transfer.png")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.outputs = outputs_from_args(p, args)
    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    if not connectors or set(connectors) - set(CONNECTORS):
        p.error(f"--connectors must name some of {CONNECTORS}")
    args.connectors = connectors
    args.layouts = (args.layouts or ("tiny" if args.quick else "tiny,llama3-8b")).split(",")
    args.tokens = args.tokens or list(QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    all_layouts = make_layouts(args.device)
    unknown = set(args.layouts) - set(all_layouts)
    if unknown:
        raise ValueError(f"unknown layouts {sorted(unknown)}; choose from {sorted(all_layouts)}")
    layouts = {name: all_layouts[name] for name in args.layouts}
    points, skipped = plan(args.connectors, layouts, args.tokens, args.max_bytes, args.device)
    load_start = os.getloadavg()[0]
    results = []
    for connector in args.connectors:
        mine = [p for p in points if p.connector == connector]
        if mine:
            results += run_connector(connector, mine, args.repeats, args.device)
    report = {
        "benchmark": "kv_transfer",
        "command": command_line("bench_kv_transfer.py", list(argv)),
        "machine": machine(),
        "device": args.device,
        "repeats": args.repeats,
        "max_bytes": args.max_bytes,
        "goals": GOALS,
        "raw": RAW_NAMES,
        "load_avg": [load_start, os.getloadavg()[0]],
        "layouts": {
            n: {
                **lay.to_dict(),
                "bytes_per_token": lay.page_bytes * lay.num_layers // lay.block_size,
            }
            for n, lay in layouts.items()
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
            row = bench.run_point(point, repeats)
            print(progress_line(row), flush=True)
            results.append(row)
        return results
    finally:
        bench.close()


def progress_line(r: dict[str, Any]) -> str:
    w = r["whole"]
    return (
        f"{r['connector']:5s} {r['layout']:10s} {fmt_tokens(r['tokens']):>5s} "
        f"{r['bytes'] / 2**20:9.2f} MiB  {w['ms']:9.2f} ms {w['gb_s']:6.2f} GB/s  "
        f"raw {w['raw_gb_s']:6.2f} GB/s  ratio {w['ratio']:.2f}  ok={r['ok']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.child:
        child_main(args.child, args.device)
        return 0
    report = run(args, argv)
    for s in report["skipped"]:
        print(f"skipped {s['connector']} {s['layout']} {fmt_tokens(s['tokens'])}: {s['reason']}")
    publish("kv_transfer", report, args.outputs, plot, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())

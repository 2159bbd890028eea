"""The ranks of a tensor-parallel engine: rank 0 is the engine itself (scheduler, KV cache
manager, sampling, the node around them) and drives N - 1 worker processes, each holding its
shard of the model and its share of the KV cache, that run every step's forward with it.

Each step, rank 0 broadcasts what every rank needs to build the step's inputs (the scheduled
sequences' tokens, positions and blocks, a `Step`) and all ranks run the forward, joined by
the model's all-reduces. A worker waits for the next step at most `timeout_s`; rank 0 sends a
keep-alive while idle, so an idle worker whose rank 0 is gone (or stopped) exits.

Steps are typed messages of their own plane (`Step`, `STEPS`). Besides steps, rank 0 can
`call` every rank's agent (the node's per-rank part, e.g. its KV connector end, named in the
worker's spec as "module:Class") with a typed command of the agent's plane
(`common.wire.ranks`): the same command runs on every rank and rank 0 gets every rank's typed
answer. The worker process itself is `tensor_parallel_worker`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from pdserve.common.engine.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.common.engine.scheduler import ScheduledSeq
from pdserve.common.model.parallel import TPGroup, TPShard, join_group
from pdserve.common.rendezvous import listening_store
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.wire.messages import Message, Plane, encode
from pdserve.common.wire.payloads import SamplingParams
from pdserve.common.wire.ranks import RankCommand, RankPlane
from pdserve.testbed import zygote

# The kinds of what rank 0 broadcasts (a header's first number).
STEP, KEEPALIVE, STOP, CALL = 1, 2, 3, 4


class GroupBroken(Exception):
    """A tensor-parallel rank is gone (or unreachable): the node cannot run another step and
    stops as a whole. Not a RuntimeError on purpose: code that treats a failed KV send as
    its destination's fault must not take a lost rank of its own for one."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs to build its model runner: JSON that rank 0 leaves in the
    rendezvous store (`spec_key`), where the worker reads it."""

    rank: int
    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig
    max_num_seqs: int
    max_model_len: int | None
    # A draft_model's: every rank holds its shard of the draft and computes its pages.
    speculative: SpeculativeConfig | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        return cls(
            rank=d["rank"],
            model=ModelConfig(**d["model"]),
            cache=CacheConfig(**d["cache"]),
            parallel=ParallelConfig(**d["parallel"]),
            max_num_seqs=d["max_num_seqs"],
            max_model_len=d["max_model_len"],
            speculative=SpeculativeConfig(**d["speculative"]) if d.get("speculative") else None,
        )


def threads_per_rank(parallel: ParallelConfig) -> int:
    if parallel.threads_per_rank is not None:
        return parallel.threads_per_rank
    return max(1, (os.cpu_count() or 1) // parallel.tensor_parallel_size)


def open_group(
    shard: TPShard,
    store: dist.Store,
    port: int,
    parallel: ParallelConfig,
    device: str,
    own_host: str | None = None,
) -> TPGroup:
    """This rank's member of the group whose rendezvous is `store` (served on `port`).

    A group on one host talks over loopback only; across hosts each rank binds its gloo
    connections to the address it was given (`own_host`: rank 0's --host, a worker's
    --advertise-host or --host), or where none is specific, to what its host name resolves to."""
    name = f"pdserve-tp-{port}-{shard.rank}"
    if parallel.workers == "local":
        gloo_host = "127.0.0.1"
    else:
        gloo_host = None if own_host in (None, "", "0.0.0.0", "::") else own_host
    return join_group(shard, store, parallel.timeout_s, device, name, gloo_host)


def spec_key(rank: int) -> str:
    """Where rank 0 leaves a worker's spec in the rendezvous store."""
    return f"pdserve/spec/{rank}"


STEPS = Plane("tensor-parallel steps")


@dataclass(frozen=True, slots=True)
class StepSeq:
    """The part of a scheduled sequence every rank needs for its forward (rank 0 samples)."""

    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    prompt_targets: tuple[int, ...]
    prompt_target_pos: int
    num_drafts: int = 0  # a verify step's logits rows, gathered on every rank


@STEPS.register
@dataclass(frozen=True, slots=True)
class Step(Message):
    """One step for every worker: its sequences, whether it runs compiled, the message its
    agent builds the step's layer hook from, encoded on the agent's plane (b"": none), and the
    W3C traceparents of the node spans its traced requests' rank spans go under (tracing)."""

    TYPE: ClassVar[str] = "tp.step"
    compiled: bool
    seqs: tuple[StepSeq, ...]
    hook: bytes = b""
    traces: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        seqs: tuple[ScheduledSeq, ...],
        compiled: bool,
        hook: Message | None,
        traces: tuple[str, ...] = (),
    ) -> Step:
        rows = tuple(
            StepSeq(s.token_ids, s.start_pos, s.block_ids, s.sample, s.prompt_targets,
                    s.prompt_target_pos, s.num_drafts)
            for s in seqs
        )  # fmt: skip
        return cls(compiled, rows, b"" if hook is None else encode(hook), traces)

    def scheduled(self) -> tuple[ScheduledSeq, ...]:
        plain = SamplingParams()  # sampling happens on rank 0 only
        return tuple(
            ScheduledSeq("", s.token_ids, s.start_pos, s.block_ids, s.sample, plain,
                         prompt_targets=s.prompt_targets, prompt_target_pos=s.prompt_target_pos,
                         num_drafts=s.num_drafts)
            for s in self.seqs
        )  # fmt: skip


class StepChannel:
    """Rank 0's commands to the workers over the group itself: a header (kind, bytes) and
    the payload, each one broadcast."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.group.broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64))
        if payload:
            self.group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def gather(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, in rank order (every rank calls this together)."""
        sizes = self.group.all_gather(torch.tensor([len(payload)], dtype=torch.int64))
        longest = int(sizes.max())
        buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
        if payload:  # rank 0 gives nothing (b""): frombuffer refuses an empty buffer
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self.group.all_gather(buf)
        return [rows[r, : int(sizes[r])].numpy().tobytes() for r in range(self.group.size)]

    def recv(self) -> tuple[int, bytes]:
        header = self.group.broadcast(torch.zeros(2, dtype=torch.int64))
        kind, size = int(header[0]), int(header[1])
        if not size:
            return kind, b""
        return kind, self.group.broadcast(torch.empty(size, dtype=torch.uint8)).numpy().tobytes()


class RankDriver:
    """Rank 0's side: starts the workers, sends each step, keeps idle workers alive, stops
    them. A worker that dies makes rank 0's next collective raise (gloo sees the closed
    connection at once), and the engine with it: the group fails as one."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        parallel: ParallelConfig,
        max_num_seqs: int,
        max_model_len: int | None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.parallel = parallel
        size = parallel.tensor_parallel_size
        start = datetime.timedelta(seconds=parallel.start_timeout_s)
        host, port = parallel.host, parallel.port
        store = listening_store(host, port, size, start)
        for r in range(1, size):  # each worker reads its spec from the rendezvous
            spec = WorkerSpec(r, model, cache, parallel, max_num_seqs, max_model_len, speculative)
            store.set(spec_key(r), spec.to_json())
        local = parallel.workers == "local"
        self.procs = [_spawn(store.port, r, parallel) for r in range(1, size)] if local else []
        shard = TPShard(0, size, model.enable_expert_parallel)
        try:
            self.group = open_group(shard, store, store.port, parallel, model.device, host)
        except Exception:
            self._kill()
            raise
        self._store = store  # the rendezvous lives as long as the group
        self.channel = StepChannel(self.group)
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._broken = ""  # why the keep-alive found the group broken

    def start(self) -> None:
        """Keep idle workers alive from now on (after the ranks' start-up collectives)."""
        threading.Thread(target=self._keep_alive, daemon=True, name="tp-alive").start()

    def send_step(
        self,
        seqs: tuple[ScheduledSeq, ...],
        compiled: bool,
        hook: Message | None = None,
        traces: tuple[str, ...] = (),
    ) -> None:
        """Call with `group.lock` held, through the step's last collective. `hook`: what the
        workers' agents build the step's layer hook from (a message of their plane); `traces`:
        the node spans the workers' spans of this step go under (`Step.traces`)."""
        step = Step.of(seqs, compiled, hook, traces)
        self._checked(self.channel.send, STEP, encode(step))

    def call(
        self, plane: RankPlane, command: RankCommand, local: Callable[[], Message]
    ) -> list[Message]:
        """Run `command` on every worker's agent (of `plane`) and `local()` here, between the
        command going out and the answers coming back; every rank's answer, in rank order,
        each of the command's REPLY type. A worker's refusal raises RankCommandError naming
        its rank; `local()`'s exception is raised as it is, but only after the gather: the
        workers wait in it, and a rank 0 that skipped it would leave them there until the
        collective's timeout broke the group."""
        with self.group.lock:
            self._checked(self.channel.send, CALL, encode(command))
            try:
                mine, failed = local(), None
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the gather
                mine, failed = None, exc
            replies = self._checked(self.channel.gather, b"")
        if failed is not None:
            raise failed
        assert isinstance(mine, command.REPLY), f"{command.TYPE} answered {mine!r} here"
        rest = [plane.reply(command, raw, rank) for rank, raw in enumerate(replies[1:], 1)]
        return [mine, *rest]

    def _checked(self, collective: Callable[..., Any], *args: Any) -> Any:
        """Run a collective of the command channel; GroupBroken when a rank is gone."""
        try:
            result = collective(*args)
            self._last_send = time.monotonic()
            return result
        except RuntimeError as exc:
            raise GroupBroken(f"{self.exits()}: {exc}") from exc

    def broken(self) -> str | None:
        """Why the group cannot run another step (a worker exited, a keep-alive failed), or
        None; cheap enough for every turn of a node's loop. (External workers are not this
        process's children: their loss shows in the next collective or keep-alive.)"""
        if any(p.poll() is not None for p in self.procs):
            return self.exits()
        return self._broken or None

    def exits(self) -> str:
        codes = [(r, p.poll()) for r, p in enumerate(self.procs, start=1)]
        dead = [f"rank {r} exited with {c}" for r, c in codes if c is not None]
        if dead:
            return "; ".join(dead)
        return "no worker exited" if self.procs else "a worker rank on another host is gone"

    def _keep_alive(self) -> None:
        interval = self.parallel.timeout_s / 4
        while not self._closed.wait(interval / 4):
            if time.monotonic() - self._last_send < interval:
                continue
            with self.group.lock:
                if self._closed.is_set():
                    return
                try:
                    self._checked(self.channel.send, KEEPALIVE)
                except GroupBroken as exc:
                    self._broken = str(exc)  # `broken` says so; the next step would raise
                    return

    def close(self) -> None:
        """Stop the workers: a STOP, then a kill after the timeout; at once when the group
        is broken (a survivor would only learn it when this process exits)."""
        if self._closed.is_set():
            return
        with self.group.lock:
            self._closed.set()
            broken = self.broken() is not None
            try:
                if not broken:
                    self._checked(self.channel.send, STOP)
            except GroupBroken:
                broken = True
        if broken:
            self._kill()
        deadline = time.monotonic() + self.parallel.timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.group.close()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def _spawn(port: int, rank: int, parallel: ParallelConfig) -> subprocess.Popen:
    """A worker on this host (the same command `pdserve tp-worker` runs on another one); under
    the test suite, forked by its launcher (pdserve.testbed.zygote) where it can be."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(parallel))}
    args = ["--leader", f"127.0.0.1:{port}", "--rank", str(rank)]
    nixl = (parallel.rank_agent_options or {}).get("connector") == "nixl"  # never forked yet
    forked = None if nixl else zygote.fork_rank(["tp-worker", *args], env)
    cmd = [sys.executable, "-m", "pdserve.common.engine.tensor_parallel_worker"]
    return forked or subprocess.Popen([*cmd, *args], env=env)

"""How a CPU decode package is made, and made while the node serves (`--compile-mode
background`, the CPU default).

A package is one bucket's decode step as an AOTInductor shared library: the step exported
(`export_step`: embedding to logits, the attention op `pdserve::paged_attention` called through
the dispatcher, for one bucket's batch size; the attention metadata's sizes and the KV pool's
block count dynamic, so any batch composition and pool size runs it), then compiled ahead of
time (`compile_package`), written into the compile cache whole and renamed. It holds no weights:
`compiled_decode.DecodePackage` hands it the model's own tensors at load. Up to REDUCTION_ROWS
rows, linears are decomposed into a reduction that reads each weight row once for all rows
(see _rows_linear).

A cold compile costs minutes of CPU a bucket on a real model (SmolLM2: about 180 CPU seconds),
so a node that compiled every bucket before serving would start tens of minutes late. Instead
the runner loads the packages the compile cache already holds, serves the other buckets eager,
and `BackgroundCompile` compiles those in a child process, one bucket at a time, the bucket the
engine has used most first (the smallest on a tie). The child runs at the lowest CPU priority
(nice 19, inherited by the C++ compiler it starts), so it takes only the cycles the node leaves;
a process rather than a thread because the compile holds the GIL for long stretches and would
stall the engine's steps.

The child (compile_child.py) loads the model from the same config (its own copy of the weights,
for as long as the compile runs), checks that its compile key is the parent's (the same code,
dtype, weight form, threads) and writes the package. The parent loads it on its own thread (the
`load` it is given) and `CompiledDecode` adopts it between two steps, so a step runs wholly
eager or wholly compiled. A compile that fails, times out or is killed leaves its bucket eager,
and the parent removes the child's unfinished package file; the buckets not compiled yet stay
eager too (a model that one bucket cannot export, none can), until the next start tries again.
Nothing here runs on a request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from pdserve.common.engine.compile_cache import CompileCache
from pdserve.common.engine.config import ModelConfig
from pdserve.common.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

CHILD = "pdserve.common.engine.compile_child"  # the child's module (`python -m`)

# Up to this many rows a CPU linear is compiled as a reduction that reads each weight row once
# for all rows: 1.4x MKL's GEMV bandwidth at 1 row, 1.8x at 2, 1.2x at 4; MKL wins from 8.
REDUCTION_ROWS = 4


@dataclass(frozen=True, slots=True)
class CompileJob:
    """What a child needs to compile one bucket into the parent's cache folder: the model
    (as the runner loaded it), the graphs' flags and thread count, and the key digest its
    own key must match."""

    model: ModelConfig
    flags: str  # the JSON of the runner's compile flags (`ModelRunner._compile_cache`)
    cache_root: str
    digest: str
    threads: int
    size: int  # the bucket (0 in the template BackgroundCompile is given)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "model": asdict(self.model)})

    @classmethod
    def from_json(cls, text: str) -> CompileJob:
        fields = json.loads(text)
        return cls(**{**fields, "model": ModelConfig(**fields["model"])})


class Handover(Protocol):
    """Who takes the packages (compiled_decode.py `ReadyBuckets`, which the engine's step reads:
    named here by its methods, so this module imports nothing of the step's)."""

    def most_used(self, sizes: list[int]) -> int: ...
    def put(self, size: int, package: object) -> None: ...


class BackgroundCompile:
    """Compiles `missing` buckets one child process at a time, on a thread of its own; each
    package, once loaded by `load`, is put into `ready` for the engine to adopt. The next child
    compiles the bucket still missing that `ready` says the engine used most.

    `close()` stops the child and the thread (a node's shutdown)."""

    def __init__(
        self,
        job: CompileJob,
        missing: tuple[int, ...],
        load: Callable[[int], object],
        ready: Handover,
        timeout_s: float = 3600.0,
    ) -> None:
        self.job, self.load, self.ready, self.timeout_s = job, load, ready, timeout_s
        self.compiled: list[int] = []  # buckets compiled and loaded, in order
        self.failed: list[int] = []  # buckets left eager
        self.child: subprocess.Popen | None = None  # the latest child started
        self._missing = sorted(missing)  # the thread's alone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-compile", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        """Wait until every bucket is compiled or failed; whether that happened in time."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def command(self, job: CompileJob) -> list[str]:
        """The child's command line (a test stands in a child that fails)."""
        return [sys.executable, "-m", CHILD, job.to_json()]

    def _next(self) -> int | None:
        if not self._missing:
            return None
        size = self.ready.most_used(self._missing)
        self._missing.remove(size)
        return size

    def _run(self) -> None:
        while not self._stop.is_set() and (size := self._next()) is not None:
            start = time.perf_counter()
            try:
                package = self._compile(size)
            except Exception:  # whatever went wrong, the bucket stays eager and the node serves
                log.exception("decode bucket %d stays eager: its background compile failed", size)
                package = None
            if package is None:  # what failed one bucket (a model export cannot trace, say)
                self.failed += [size, *self._missing]  # fails the rest alike: they stay eager
                self._missing.clear()  # until the next start
                return
            self.ready.put(size, package)
            self.compiled.append(size)
            log.info("decode bucket %d compiled in %.0f s", size, time.perf_counter() - start)

    def _compile(self, size: int) -> object | None:
        """Run one child for `size`; its package, loaded, or None (logged) if none came."""
        job = replace(self.job, size=size)
        log_path = package_file(Path(job.cache_root) / job.digest, size).with_suffix(".log")
        with open(log_path, "wb") as out:
            child = subprocess.Popen(
                self.command(job),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its compiler's processes are stopped with it
            )
            self.child = child
            rc = self._wait(child)
        if rc != 0:
            tmp_package_path(log_path.parent, size, child.pid).unlink(missing_ok=True)
            if not self._stop.is_set():
                log.warning(
                    "decode bucket %d stays eager: compile exited %s (%s)", size, rc, log_path
                )
            return None
        try:
            return self.load(size)
        except (OSError, RuntimeError) as e:
            log.warning("decode bucket %d stays eager: its package did not load: %s", size, e)
            return None

    def _wait(self, child: subprocess.Popen) -> int | None:
        """The child's exit status; it is killed on close() or past timeout_s (None then)."""
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return child.wait(timeout=0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        return None


def package_file(folder: Path, size: int) -> Path:
    return folder / f"decode-{size}.pt2"


def tmp_package_path(folder: Path, size: int, pid: int) -> Path:
    """Where process `pid` writes the package before renaming it: named by the writer, so a
    compile killed before its cleanup leaves a file its parent can find and remove."""
    return folder / f"decode-{size}.tmp-{pid}.pt2"  # .pt2: the packager insists


class DecodeStep(torch.nn.Module):
    """A decode step with tensors only in and out (what torch.export takes): the metadata's
    four tensors travel flat. Its constants' names are the model's, under `model.`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        # The two ints are host-side hints the CPU attention never reads.
        attn = AttentionMetadata(slot_mapping, block_tables, query_start_loc, seq_lens, 1, 1)
        return self.model.compute_logits(self.model(input_ids, positions, attn, kv_caches))


def compile_package(
    model: torch.nn.Module, size: int, kv_caches: list[torch.Tensor], cache: CompileCache
) -> None:
    """Export the decode step of `size` rows and compile it into its package in `cache`'s
    folder (written whole, then renamed: a start never sees half a package)."""
    from torch._inductor import aoti_compile_and_package  # the compiler: only when compiling

    program = export_step(model, size, kv_caches)
    if size <= REDUCTION_ROWS:
        program = program.run_decompositions({torch.ops.aten.linear.default: _rows_linear})
    tmp = tmp_package_path(cache.path, size, os.getpid())
    try:
        configs = {"aot_inductor.package_constants_in_so": False}  # weights come at load
        aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
        os.replace(tmp, package_file(cache.path, size))
    finally:
        tmp.unlink(missing_ok=True)


def export_step(
    model: torch.nn.Module, size: int, kv_caches: list[torch.Tensor]
) -> torch.export.ExportedProgram:
    """The decode step of `size` rows as an exported program. Dynamic: the metadata's rows
    (a bucket runs batches from the last bucket + 1 up to `size`), the block tables' width and
    the pool's block count; example metadata: `size` sequences in slot 0 of the null block."""
    from torch.export import Dim

    rows = Dim.STATIC if size == 1 else Dim.DYNAMIC
    i64 = {"dtype": torch.int64}
    i32 = {"dtype": torch.int32}
    example = (
        torch.zeros(size, **i64),
        torch.zeros(size, **i64),
        torch.zeros(size, **i64),
        torch.zeros(size, 2, **i32),  # two blocks wide: a width of 1 would be specialized
        torch.arange(size + 1, **i32),
        torch.ones(size, **i32),
        list(kv_caches),
    )
    shapes = (
        {0: Dim.STATIC},
        {0: Dim.STATIC},
        {0: rows},
        {0: rows, 1: Dim.DYNAMIC},
        {0: rows},
        {0: rows},
        [{1: Dim.DYNAMIC} for _ in kv_caches],
    )
    with torch.no_grad():
        return torch.export.export(DecodeStep(model), example, dynamic_shapes=shapes, strict=False)


def _rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear of few rows x [M, K] as a reduction laid out [N, M]: inductor's loop reads each
    weight row once for all M rows, at about the bandwidth of a plain sum."""
    if x.dim() != 2:  # not a flat batch of token rows: a plain product
        out = torch.matmul(x, weight.t())
        return out if bias is None else out + bias
    out = (weight[:, None, :] * x[None, :, :]).sum(-1).t()
    return out if bias is None else out + bias

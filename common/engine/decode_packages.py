"""Compiled CPU decode steps as AOTInductor packages: one shared library per batch bucket, made
once (torch.export, then inductor's ahead-of-time C++ compile) and kept in the compile cache.

Why not torch.compile with its on-disk caches, as on CUDA: even when every kernel comes from
the cache, a start imports Dynamo and inductor (about 3.5 CPU seconds here, more than a whole
eager start of the tiny model) and Dynamo traces each bucket again. A package is loaded by
torch's C++ loader (`torch._C._aoti`) without importing either: a warm start adds milliseconds.

What a package holds: the same step as `CompiledDecode._forward` (embedding to logits, the
attention op `pdserve::paged_attention` called through the dispatcher), for one bucket's batch
size; the attention metadata's sizes and the KV pool's block count are dynamic, so any batch
composition and pool size runs it. It does not hold the weights: they are handed to it at load,
by name, as the model's own tensors (no copy). Up to REDUCTION_ROWS rows, linears are
decomposed into a reduction that reads each weight row once for all rows (see _rows_linear).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pdserve.common.engine.compile_cache import CacheCounts, CompileCache
from pdserve.common.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

# Up to this many rows a CPU linear is compiled as a reduction that reads each weight row once
# for all rows: 1.4x MKL's GEMV bandwidth at 1 row, 1.8x at 2, 1.2x at 4; MKL wins from 8.
REDUCTION_ROWS = 4


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


class DecodePackage:
    """One bucket's loaded package, bound to the model's weights: `(ids, positions, attn,
    kv_caches) -> logits` of `size` rows (ids and positions padded to it)."""

    def __init__(self, path: Path, model: torch.nn.Module) -> None:
        # Run with the GIL-free runner's locking (False): steps may come from any thread.
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        names = self.loader.get_constant_fqns()
        missing = [n for n in names if n.removeprefix("model.") not in tensors]
        if missing:
            raise RuntimeError(f"{path} wants tensors the model does not have: {missing[:5]}")
        constants = {n: tensors[n.removeprefix("model.")] for n in names}
        # user_managed: the package reads the model's own tensors, which the runner keeps alive.
        self.loader.load_constants(constants, False, True, True, False)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        return self.loader.boxed_run([input_ids, positions, *attn.tensors(), *kv_caches])[0]


def load_packages(
    model: torch.nn.Module,
    buckets: tuple[int, ...],
    kv_caches: list[torch.Tensor],
    cache: CompileCache,
    compile_missing: bool = True,
) -> tuple[dict[int, DecodePackage], CacheCounts]:
    """Every bucket's package from `cache`'s folder, compiling those it lacks (or cannot
    load) unless told not to; the packages, and how many were loaded (hits) and compiled or
    left to compile (misses)."""
    packages, missing = {}, []
    for size in buckets:
        try:
            packages[size] = DecodePackage(package_path(cache, size), model)
        except (OSError, RuntimeError) as e:  # absent, or unreadable: made again
            if package_path(cache, size).exists():
                log.warning("compiling decode bucket %d again: %s", size, e)
            missing.append(size)
    if missing and compile_missing:
        cache.run(lambda: [compile_package(model, size, kv_caches, cache) for size in missing])
        packages.update({s: DecodePackage(package_path(cache, s), model) for s in missing})
    return packages, CacheCounts(hits=len(buckets) - len(missing), misses=len(missing))


def package_path(cache: CompileCache, size: int) -> Path:
    return package_file(cache.path, size)


def package_file(folder: Path, size: int) -> Path:
    return folder / f"decode-{size}.pt2"


def tmp_package_path(folder: Path, size: int, pid: int) -> Path:
    """Where process `pid` writes the package before renaming it: named by the writer, so a
    compile killed before its cleanup leaves a file its parent can find and remove."""
    return folder / f"decode-{size}.tmp-{pid}.pt2"  # .pt2: the packager insists


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
        os.replace(tmp, package_path(cache, size))
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

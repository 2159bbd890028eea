"""The child a background compile starts (`python -m pdserve.common.engine.compile_child JOB`):
load the model as the node's runner did, check that its compile key is the parent's, compile
one bucket's package into the parent's cache folder (background_compile.py says how and why),
at the lowest CPU priority and dying with its parent. Nothing imports this module: it imports
the runner, which imports the compile, so the child's own imports stay one way."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
from pathlib import Path

import torch

from pdserve.common.engine.background_compile import CompileJob, compile_package, package_file
from pdserve.common.engine.compile_cache import CompileCache, compile_key
from pdserve.common.engine.compiled_decode import code_hash
from pdserve.common.engine.model_runner import load_runner_model

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _lowest_priority() -> None:
    """Nice 19 (inherited by the compiler's processes): next to a busy node at nice 0 the
    child gets about 1/70 of a core. Not SCHED_IDLE: on a machine kept busy by other nice-19
    work (a test suite beside a benchmark) an idle-class compile never ran at all. Set, not
    added: os.nice(19) under a node at nice -10 left the child at nice 9."""
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    with contextlib.suppress(OSError):  # die with the parent (a node killed mid-compile)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def compile_job(job: CompileJob) -> Path:
    """In the child: load the model as the runner does, and compile the bucket's package."""
    torch.set_num_threads(job.threads)  # the parent's: generated loops fix it
    model, arch = load_runner_model(job.model)
    dtype = getattr(torch, job.model.dtype)  # resolved by the parent's ModelConfig
    key = compile_key(model, arch, dtype, json.loads(job.flags), code_hash())
    if key.digest() != job.digest:
        raise RuntimeError(f"the child's compile key {key} is not the parent's {job.digest}")
    cache = CompileCache(Path(job.cache_root), key)
    block_size = json.loads(job.flags)["block_size"]
    spec = type(model).kv_cache_spec(arch, None)
    # A small pool: the package's block count is dynamic (two or more: one is specialized).
    kv_caches = [
        torch.zeros(spec.shape(4, block_size), dtype=dtype) for _ in range(arch.num_layers)
    ]
    cache.run(lambda: compile_package(model, job.size, kv_caches, cache))
    return package_file(cache.path, job.size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="compile one decode bucket (a node's child)")
    parser.add_argument("job", help="the CompileJob as JSON")
    args = parser.parse_args(argv)
    _lowest_priority()
    logging.basicConfig(level=logging.INFO)
    print(compile_job(CompileJob.from_json(args.job)), flush=True)


if __name__ == "__main__":
    main()

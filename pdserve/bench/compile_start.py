"""`python -m pdserve.bench.compile_start MODEL`: how long an engine takes to start eager, and
compiled with its compile cache cold and then warm, each in a fresh process (the way a node
starts), with the graphs the cache gave (hits) and the ones compiled (misses).

A warm start should compile nothing (misses 0). With --repeat N the eager and warm starts run
N times, alternating (a loaded machine's noise falls on both), and the ratio of their medians
is printed, of wall time and of the process's CPU time. Prints one JSON line per start, then
a table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# The child: one engine built in a fresh process, timed from the first import.
_CHILD = """
import json, resource, sys, time
start = time.perf_counter()
from pdserve.common.engine.llm import LLM
imported = time.perf_counter()
if sys.argv[3] != "None":
    import torch
    torch.set_num_threads(int(sys.argv[3]))
llm = LLM(sys.argv[1], skip_tokenizer_init=True, **json.loads(sys.argv[2]))
built = time.perf_counter()
compiled = llm.engine.runner.compiled
counts = compiled.cache_counts if compiled is not None else None
cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,
          resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
print(json.dumps({"import_s": imported - start, "build_s": built - imported, "cpu_s": cpu,
                  "compile_s": compiled.compile_seconds if compiled is not None else 0.0,
                  "hits": counts.hits if counts else 0, "misses": counts.misses if counts else 0,
                  "compiler_imported": "torch._dynamo" in sys.modules}))
"""


@dataclass(frozen=True, slots=True)
class Start:
    """One engine start in a fresh process: seconds importing pdserve, building the engine
    (loading and compiling), CPU seconds of both (the compiler's child processes included), of
    which compiling; the compile cache's hits and misses."""

    import_s: float
    build_s: float
    cpu_s: float
    compile_s: float
    hits: int
    misses: int
    compiler_imported: bool  # whether the start imported Dynamo (seconds of a start)


def start_once(
    model: str,
    engine: dict[str, object],
    timeout_s: float = 1800.0,
    threads: int | None = None,
) -> Start:
    """Start an engine of `model` with LLM keyword arguments `engine` in a fresh process (its
    environment: this one's, so $PDSERVE_COMPILE_CACHE_DIR names the cache), with `threads`
    intra-op threads (None: torch's default), a part of the compile cache's key."""
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, model, json.dumps(engine), str(threads)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if child.returncode != 0:
        raise RuntimeError(f"the engine's start failed:\n{child.stderr[-3000:]}")
    return Start(**json.loads(child.stdout.splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", help="checkpoint directory or GGUF")
    p.add_argument("--max-num-seqs", type=int, default=64, help="buckets 1, 2, 4, ... up to it")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache-dir", help="compile cache (default: a new temporary one: cold)")
    p.add_argument("--repeat", type=int, default=1, help="eager and warm starts, alternating")
    p.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="pdserve-compile-start-")
    engine = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype}
    compiled = {**engine, "enforce_eager": False, "compile_cache_dir": cache}
    eager = {**engine, "enforce_eager": True}
    plan = [("eager", eager), ("compiled, cache cold", compiled)]
    plan += [("compiled, cache warm", compiled), ("eager", eager)] * args.repeat
    starts = []
    for name, kwargs in plan:
        starts.append((name, start_once(args.model, kwargs, threads=args.threads)))
        print(json.dumps({"start": name, **asdict(starts[-1][1])}), flush=True)
    print("| start | import s | engine build s | CPU s | of which compile s | hits | misses |")
    print("|---|---|---|---|---|---|---|")
    for name, start in starts:
        seconds = (start.import_s, start.build_s, start.cpu_s, start.compile_s)
        cells = (name, *(f"{v:.1f}" for v in seconds), str(start.hits), str(start.misses))
        print("| " + " | ".join(cells) + " |")
    for what, of in (("wall", lambda s: s.import_s + s.build_s), ("CPU", lambda s: s.cpu_s)):
        warm, eager_s = (
            statistics.median(of(s) for n, s in starts if n == name)
            for name in ("compiled, cache warm", "eager")
        )
        print(f"warm / eager, {what}: {warm:.2f} / {eager_s:.2f} s = {warm / eager_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

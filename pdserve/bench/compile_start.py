"""`python -m pdserve.bench.compile_start MODEL`: how long an engine takes to start eager, and
compiled with its compile cache cold and then warm, each in a fresh process (the way a node
starts), with the graphs the cache gave (hits) and the ones compiled (misses).

A warm start should compile nothing (misses 0); what it still costs over eager is Dynamo's
tracing of every bucket and the compiler's imports. Prints one JSON line per start, then a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# The child: one engine built in a fresh process, timed from the first import.
_CHILD = """
import json, sys, time
start = time.perf_counter()
from pdserve.common.engine.llm import LLM
imported = time.perf_counter()
llm = LLM(sys.argv[1], skip_tokenizer_init=True, **json.loads(sys.argv[2]))
built = time.perf_counter()
compiled = llm.engine.runner.compiled
counts = compiled.cache_counts if compiled is not None else None
print(json.dumps({"import_s": imported - start, "build_s": built - imported,
                  "compile_s": compiled.compile_seconds if compiled is not None else 0.0,
                  "hits": counts.hits if counts else 0, "misses": counts.misses if counts else 0}))
"""


@dataclass(frozen=True, slots=True)
class Start:
    """One engine start in a fresh process: seconds importing pdserve, building the engine
    (loading and compiling), of which compiling; the compile cache's hits and misses."""

    import_s: float
    build_s: float
    compile_s: float
    hits: int
    misses: int


def start_once(model: str, engine: dict[str, object], timeout_s: float = 1800.0) -> Start:
    """Start an engine of `model` with LLM keyword arguments `engine` in a fresh process (its
    environment: this one's, so $PDSERVE_COMPILE_CACHE_DIR names the cache)."""
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, model, json.dumps(engine)],
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
    args = p.parse_args(argv)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="pdserve-compile-start-")
    engine = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype}
    compiled = {**engine, "enforce_eager": False, "compile_cache_dir": cache}
    starts = {
        "eager": {**engine, "enforce_eager": True},
        "compiled, cache cold": compiled,
        "compiled, cache warm": compiled,
    }
    rows = []
    for name, kwargs in starts.items():
        start = start_once(args.model, kwargs)
        print(json.dumps({"start": name, **asdict(start)}), flush=True)
        cells = (name, *(f"{v:.1f}" for v in (start.import_s, start.build_s, start.compile_s)))
        rows.append("| " + " | ".join((*cells, str(start.hits), str(start.misses))) + " |")
    print("| start | import s | engine build s | of which compile s | cache hits | misses |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

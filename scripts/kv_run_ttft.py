"""A store hit's TTFT with the store's blocks read one call per block against a run at a time
(docs/benchmarks.md, KV tiers): one engine, SmolLM2-135M bf16 dense, 8-token blocks, a
209-token prompt whose 26 loadable blocks are in the store (`file://`, then a local
redis-server), the pool emptied before each request; recomputed, loaded one call per block
(the walk given no hashes), loaded as runs, rotating; 13 rounds, the first 3 not counted.

    nice -n 19 python scripts/kv_run_ttft.py
"""

import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.kv_store.local_redis import LocalRedis
from pdserve.models import smollm2

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
prompt = [random.Random(3).randrange(10, 40000) for _ in range(209)]
print("load", os.getloadavg(), flush=True)
with tempfile.TemporaryDirectory(dir=None) as d:
    server = LocalRedis(Path(d))
    server.start()
    try:
        for url in (f"file://{d}/kv", server.url):
            llm = LLM(
                str(smollm2()),
                num_blocks=64,
                block_size=8,
                quantization="none",
                enforce_eager=True,
                skip_tokenizer_init=True,
                kv_store=url,
            )
            tiers, kv = llm.engine.tiers, llm.engine.kv
            (want,) = llm.generate([prompt], ONE)
            for h, b in list(kv.pool.cached.items()):
                tiers.offload(h, b.block_id, wait=True)
            walk, load = tiers.begin_walk, tiers.load
            modes = {
                "recompute": (walk, lambda *a: False),
                "per-block": (lambda f, e, hashes=(), walk=walk: walk(f, e), load),
                "run": (walk, load),
            }
            res = {m: [] for m in modes}
            for rep in range(13):
                order = list(modes)[rep % 3 :] + list(modes)[: rep % 3]
                for m in order:
                    tiers.begin_walk, tiers.load = modes[m]
                    assert kv.reset_prefix_cache()
                    th = kv.stats.tier_hits
                    w = time.perf_counter()
                    (out,) = llm.generate([prompt], ONE)
                    if rep >= 3:
                        res[m].append((time.perf_counter() - w) * 1e3)
                    assert out.token_ids == want.token_ids
                    assert kv.stats.tier_hits - th == (0 if m == "recompute" else 208), m
            for m, xs in res.items():
                print(
                    f"{url.split(':')[0]} {m}: TTFT median {statistics.median(xs):.0f} ms, "
                    f"min {min(xs):.0f}, max {max(xs):.0f} ({len(xs)})",
                    flush=True,
                )
            llm.close()
    finally:
        server.kill()
print("load", os.getloadavg())

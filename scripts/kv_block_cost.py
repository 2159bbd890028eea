"""CPU cost of one KV block beside its read (docs/benchmarks.md, "The marginal cost model"):
an evicted block's gather and queueing on the caller's path (one fence per block, as each
eviction copied its block before the fence existed, against one fence for the step's 40, in
turn), the writer thread's encode, checksum and `file://` write, and a load back from the
store. The block is SmolLM2-135M's in
bf16 at 8 tokens (30 layers, 3 KV heads of 64: 184 KB); one torch thread; the store in a
temporary folder under --dir.

    nice -n 19 python scripts/kv_block_cost.py --dir /tmp/h7
"""

import argparse
import tempfile
import time

import torch

from pdserve.kv_store import FileTier, TierChain
from pdserve.kv_store.cost import LoadCost, PrefillCost
from pdserve.kv_store.key import KeySpace
from pdserve.kv_store.pool_tiers import PoolTiers

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--dir", default=None, help="where the temporary store goes")
args = p.parse_args()
torch.set_num_threads(1)
caches = [torch.randn(2, 64, 8, 3, 64).to(torch.bfloat16) for _ in range(30)]
with tempfile.TemporaryDirectory(dir=args.dir) as d:
    t = PoolTiers(
        TierChain([FileTier(d)], behind_bytes=64 << 20),
        KeySpace("ab" * 32),
        caches,
        8,
        LoadCost(PrefillCost(), "always"),
    )
    for rep in range(6):
        n, batched = 40, rep % 2 == 1
        p0, c0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        for i in range(n):
            t.offload(bytes([rep, i]), i)
            if not batched:
                t.fence()
        t.fence()
        c1 = time.thread_time()
        t.chain.flush(60)
        p1, w1 = time.process_time(), time.perf_counter()
        path_ms, writer_ms = (c1 - c0) / n * 1e3, ((p1 - p0) - (c1 - c0)) / n * 1e3
        drain_ms = (w1 - w0) / n * 1e3
        how = "one fence for all" if batched else "one fence a block"
        print(f"offload on the caller ({how}): {path_ms:.2f} CPU ms/block; writer thread "
              f"{writer_ms:.2f} CPU ms/block; wall to drain {drain_ms:.1f} ms/block")  # fmt: skip
        c0 = time.thread_time()
        t.begin_walk(0, n)
        for i in range(n):
            assert t.load(bytes([rep, i]), 63, i)
        print(f"  load from the store: {(time.thread_time() - c0) / n * 1e3:.2f} CPU ms/block")
    t.close()

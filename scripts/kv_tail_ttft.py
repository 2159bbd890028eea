"""The trace's worst tier-served request, reproduced (docs/benchmarks.md, kv-tiers section): a
short prompt that loads a few blocks from a tier and evicts a few dozen new ones, which the
store's writer thread must encode, checksum and write, against recomputing it.

Each round's prompt is 4 blocks that four rounds ago's prompt began with (evicted from the
pool since: a tier holds them) and `--new` fresh tokens. One engine per system side by side
(SmolLM2 bf16 dense, 8-token blocks, a 64-block pool), each round sent to each in turn, the
order rotating; before each request the other systems' write queues are drained (not timed),
so a request meets only its own evictions' writes: the one-request-at-a-time regime, where a
node is idle between requests. Systems: none; host (a 1 GiB host tier); file and redis with
the writer yielding during forwards (`WriteBehind.yields`, the default) and with it off
("-busy"). Prints per system the TTFT median, p90 and worst against none's of the same round,
and CPU (process) medians.

    nice -n 19 python scripts/kv_tail_ttft.py --rounds 24
"""

import argparse
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.kv_store.local_redis import LocalRedis
from pdserve.models import smollm2

BLOCK, HEAD = 8, 4
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine(system: str, folder: Path, stack: ExitStack) -> LLM:
    opts: dict = {}
    if system == "host":
        opts["kv_offload_bytes"] = 1 << 30
    elif system.startswith("file"):
        opts["kv_store"] = f"file://{folder / system}"
    elif system.startswith("redis"):
        (folder / system).mkdir()
        server = LocalRedis(folder / system)
        server.start()
        stack.callback(server.kill)
        opts["kv_store"] = server.url
    llm = LLM(str(smollm2()), dtype="auto", quantization="none", num_blocks=64,
              block_size=BLOCK, enforce_eager=True, skip_tokenizer_init=True, **opts)  # fmt: skip
    stack.callback(llm.close)
    if llm.engine.tiers is not None:
        for behind in llm.engine.tiers.chain.behind.values():
            behind.yields = not system.endswith("-busy")
    llm.generate([[1] * BLOCK], FIRST)  # warm-up
    return llm


def drain(llm: LLM) -> None:
    if llm.engine.tiers is not None:
        llm.engine.tiers.chain.flush(60.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=24, help="counted rounds (4 more warm up)")
    p.add_argument("--new", type=int, default=184, help="fresh tokens a prompt (23 blocks)")
    p.add_argument("--systems", default="none,file,file-busy,redis,redis-busy")
    args = p.parse_args()
    systems = args.systems.split(",")
    rng = random.Random(0)
    heads = [[rng.randrange(100, 40000) for _ in range(HEAD * BLOCK)] for _ in range(4)]
    ttft = {s: [] for s in systems}
    cpu = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        llms = {s: engine(s, Path(tmp), stack) for s in systems}
        for r in range(args.rounds + 4):
            prompt = heads[r % 4] + [rng.randrange(100, 40000) for _ in range(args.new)]
            k = r % len(systems)
            for s in systems[k:] + systems[:k]:
                for other in systems:
                    if other != s:
                        drain(llms[other])
                wall, c = time.perf_counter(), time.process_time()
                llms[s].generate([prompt], FIRST)
                if r >= 4:
                    ttft[s].append(time.perf_counter() - wall)
                    cpu[s].append(time.process_time() - c)
        loads = {s: llms[s].engine.kv.stats.tier_hits for s in systems}
    base = ttft["none"]
    for s in systems:  # the writer yielding against busy, request by request (same round)
        if f"{s}-busy" in ttft:
            paired = [b / t for b, t in zip(ttft[f"{s}-busy"], ttft[s])]
            print(f"{s}: busy writer's TTFT over a yielding one's, round by round: median "
                  f"{statistics.median(paired):.2f}x, min {min(paired):.2f}x, max "
                  f"{max(paired):.2f}x")  # fmt: skip
    for s in systems:
        ratios = sorted(b / t for b, t in zip(base, ttft[s]))
        t = sorted(ttft[s])
        print(f"{s:11s} TTFT median {1e3 * statistics.median(t):6.1f} ms, p90 "
              f"{1e3 * t[int(0.9 * len(t))]:6.1f}, max {1e3 * t[-1]:6.1f}; against none: "
              f"median {statistics.median(ratios):.2f}x, worst {ratios[0]:.2f}x; CPU median "
              f"{1e3 * statistics.median(cpu[s]):6.1f} ms; tokens loaded {loads[s]}")  # fmt: skip


if __name__ == "__main__":
    main()

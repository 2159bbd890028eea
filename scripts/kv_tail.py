"""What the slowest tier-served requests of a `pdserve bench kv-tiers` run waited on
(docs/benchmarks.md, kv-tiers section): reads the run's JSON and prints, per tier system and
workload, the worst tier-served requests against `none`'s TTFT of the same request (wall and
CPU, the tier's read time, the blocks the request's allocation evicted and wrote down, the
store writes queued when it came), the cost model's load fit per tier and the worst request
against the threshold the model's error sets, then a least-squares split of each request's extra CPU
time over `none`'s by blocks evicted and blocks loaded, and the noise floor: the spread of
the TTFT ratio over requests where the tier did nothing (nothing loaded, nothing evicted).

    python scripts/kv_tail.py /tmp/run/kv-tiers.json [--worst 5]
"""

import argparse
import json
import statistics

import numpy as np


def rows(record: dict, base: dict) -> list[dict]:
    out = []
    for i, loaded in enumerate(record["loaded"]):
        out.append({
            "i": i, "prompt": record["prompt_lengths"][i], "loaded": loaded,
            "none_ms": 1e3 * base["ttft_s"][i], "tier_ms": 1e3 * record["ttft_s"][i],
            "none_cpu": 1e3 * base["ttft_cpu_s"][i], "tier_cpu": 1e3 * record["ttft_cpu_s"][i],
            "read_ms": 1e3 * record["read_s"][i], "evicted": record["offloaded"][i],
            "queued": record["queued_writes"][i],
        })  # fmt: skip
    return out


def split_cpu(requests: list[dict], block_size: int) -> tuple[float, float, float]:
    """(fixed, per evicted block, per loaded block) CPU ms of a request over `none`'s."""
    a = np.array([[1.0, r["evicted"], r["loaded"] / block_size] for r in requests])
    y = np.array([r["tier_cpu"] - r["none_cpu"] for r in requests])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return tuple(float(c) for c in coef)


def report(record: dict, base: dict, block_size: int, worst: int) -> None:
    requests = rows(record, base)
    served = sorted((r for r in requests if r["loaded"]), key=lambda r: r["none_ms"] / r["tier_ms"])
    print(f"\n{record['workload']} / {record['system']}: {len(served)} tier-served requests")
    model(record, served)
    print("  req prompt loaded  TTFT none->tier ms (x)   CPU none->tier ms  read ms evicted queued")
    for r in served[:worst]:
        ratio = r["none_ms"] / r["tier_ms"]
        print(
            f"  {r['i']:3d} {r['prompt']:6d} {r['loaded']:6d}  {r['none_ms']:7.1f} -> "
            f"{r['tier_ms']:7.1f} ({ratio:.2f}x)  {r['none_cpu']:7.1f} -> {r['tier_cpu']:7.1f}  "
            f"{r['read_ms']:7.1f} {r['evicted']:7d} {r['queued']:6d}"
        )
    fixed, per_evicted, per_loaded = split_cpu(requests, block_size)
    print(
        f"  extra CPU ms over none's: {fixed:.2f} + {per_evicted:.2f} an evicted block "
        f"{per_loaded:+.2f} a loaded block (least squares over all {len(requests)})"
    )
    idle = [r for r in requests if not r["loaded"] and not r["evicted"]]
    spread("noise: TTFT ratio where the tier did nothing", idle)
    spread(
        "TTFT ratio where it only evicted",
        [r for r in requests if r["evicted"] and not r["loaded"]],
    )
    spread("TTFT ratio where it loaded", [r for r in requests if r["loaded"]])


def model(record: dict, served: list[dict]) -> None:
    """The cost model at the run's end (each tier's load fit, the blocks it chose to
    recompute) and the worst tier-served request against the threshold its error sets."""
    fit = record.get("model", {})
    latency = fit.get("load_latency_s", {})
    for tier, rate in fit.get("load_bytes_s", {}).items():
        chosen = fit.get("recompute_chosen", {}).get(tier, 0)
        print(
            f"  {tier}: a load {1e3 * latency.get(tier, 0.0):.2f} ms + bytes at "
            f"{rate / 1e6:.0f} MB/s, {chosen} blocks recomputed by choice"
        )
    error = record.get("model_error")
    if error is not None and served:
        worst = served[0]["none_ms"] / served[0]["tier_ms"]
        verdict = "within" if worst >= 1 / (1 + error) else "**beyond**"
        print(
            f"  model error {error:.1%}: threshold {1 / (1 + error):.3f}x, worst {worst:.3f}x "
            f"({verdict} the model's error)"
        )


def spread(what: str, requests: list[dict]) -> None:
    ratios = [r["none_ms"] / r["tier_ms"] for r in requests]
    if len(ratios) >= 3:
        q = statistics.quantiles(ratios, n=10)
        print(
            f"  {what} ({len(ratios)} requests): min {min(ratios):.2f}x, p10 {q[0]:.2f}x, "
            f"median {statistics.median(ratios):.2f}x, p90 {q[-1]:.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="the kv-tiers.json a run wrote")
    p.add_argument("--worst", type=int, default=5, help="requests listed per system")
    args = p.parse_args()
    with open(args.json) as f:
        run = json.load(f)
    block_size = run["options"]["block-size"]
    base: dict = {}
    for record in run["results"]:
        if record["system"] == "none":
            base = record
        else:
            report(record, base, block_size, args.worst)


if __name__ == "__main__":
    main()

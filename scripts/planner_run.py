"""The planner's real run (docs/benchmarks.md, "The planner on real processes"): `pdserve serve
--planner` on a tiny random model, a closed-loop load that steps up and down, every answer
checked against the offline engine, and a plot of the load, TTFT and the nodes of each role.

    nice -n -10 python scripts/planner_run.py --out docs/bench/planner_run
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from pdserve.planner.stepload import Answer, NodeSample, Phase, Serve, reference, run_load
from pdserve.tiny_model import make_tiny_model

# A model whose prefill of a long prompt costs tens of ms on a CPU core: the prefill pool is
# what a burst of long prompts fills, and what the planner must grow.
MODEL = {"layers": 4, "hidden": 256, "intermediate": 1024, "vocab": 512, "max_position": 4096}
PLANNER = ["--planner", "--interval", "4", "--window", "16", "--smoothing", "4",
           "--ttft-slo", "1", "--itl-slo", "0.2", "--max-prefill", "3", "--max-decode", "1",
           "--max-nodes", "4", "--start-timeout", "120"]  # fmt: skip
NODES = ["--num-prefill", "1", "--num-decode", "1", "--dtype", "float32", "--num-blocks", "4096",
         "--max-model-len", "2048", "--threads-per-rank", "1", "--no-prefix-caching"]  # fmt: skip
PHASES = "20x1,60x5,60x1"  # seconds x requests per second, one phase after another


def phases_of(text: str) -> list[Phase]:
    try:
        return [Phase(float(s), float(r)) for s, r in (p.split("x") for p in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"phases are SECONDSxRATE,...; got {text!r}") from None


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, MODEL["vocab"]) for _ in range(length)] for _ in range(n)]


ACTION = re.compile(r"^(\S+ \S+) INFO pdserve.planner: planner: (start|drain|flip|stop) (\w+)")


def actions(log: Path, began: float) -> list[tuple[float, str]]:
    """The planner's actions in serve's log: (s since the load began, "start prefill")."""
    out = []
    for m in filter(None, map(ACTION.match, log.read_text(errors="replace").splitlines())):
        at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - began
        out.append((at, f"{m[2]} {m[3]}"))
    return out


def plot(answers: list[Answer], samples: list[NodeSample], phases: list[Phase], slo: float,
         done: list[tuple[float, str]], path: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    edges, t = [], 0.0
    for p in phases:
        edges += [(t, p.rate), (t + p.seconds, p.rate)]
        t += p.seconds
    top.plot(*zip(*edges), color="grey", label="load (requests/s)")
    top.set_ylabel("requests per second")
    ttft = top.twinx()
    ok = [a for a in answers if a.ttft is not None]
    ttft.scatter([a.sent for a in ok], [a.ttft for a in ok], s=6, label="TTFT")
    ttft.axhline(slo, color="red", linestyle="--", label="TTFT SLO")
    ttft.set_ylabel("TTFT (s)")
    ttft.legend(loc="upper right")
    top.legend(loc="upper left")
    times = [s.at for s in samples]
    bottom.step(times, [s.prefill for s in samples], where="post", label="prefill nodes")
    bottom.step(times, [s.decode for s in samples], where="post", label="decode nodes")
    bottom.step(times, [s.draining for s in samples], where="post", label="draining", ls=":")
    for at, what in done:
        bottom.axvline(at, color="black", lw=0.6, ls="--")
        bottom.annotate(what, (at, 0.1), rotation=90, fontsize=7, ha="right")
    bottom.set_xlabel("seconds")
    bottom.set_ylabel("nodes (router's view)")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for run.json, serve.log and run.png")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--phases", type=phases_of, default=phases_of(PHASES), help=PHASES)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="the planner's p90 TTFT target (s)")
    args = p.parse_args(argv)
    planner = PLANNER.copy()
    planner[planner.index("--ttft-slo") + 1] = str(args.ttft_slo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(make_tiny_model("llama", tempfile.mkdtemp(prefix="planner-run-"), **MODEL))
    ids = prompts(32, args.prompt_tokens)
    serve = Serve(model, NODES + planner, out / "serve.log", timeout=120.0)
    try:
        want = reference(model, ids, args.max_tokens)  # while the deployment starts
        serve.wait_ready(180)
        began = time.time()
        answers, samples = run_load(serve, args.phases, ids, args.max_tokens)
    finally:
        serve.stop()
    failed = [a for a in answers if a.token_ids is None]
    wrong = [a for a in answers if a.token_ids is not None and a.token_ids != want[a.prompt]]
    report = {"answers": len(answers), "failed": len(failed), "wrong": len(wrong),
              "planner": planner, "nodes": NODES, "phases": [asdict(p) for p in args.phases],
              "samples": [asdict(s) for s in samples],
              "requests": [asdict(a) | {"token_ids": None} for a in answers]}  # fmt: skip
    (out / "run.json").write_text(json.dumps(report, indent=1))
    done = actions(out / "serve.log", began)
    report["actions"] = done
    (out / "run.json").write_text(json.dumps(report, indent=1))
    plot(answers, samples, args.phases, args.ttft_slo, done, out / "run.png")
    print(f"{len(answers)} answers, {len(failed)} failed, {len(wrong)} wrong; {out}/run.png")
    sys.exit(1 if failed or wrong else 0)


if __name__ == "__main__":
    main()

"""Run the fault-injection scenarios of tests/e2e/test_faults.py once more and write what
happened to each request, and how long recovery took, into docs/reliability.md.

    pdserve bench reliability [--out docs/reliability.md] [--requests 100]
    python scripts/reliability_report.py ...      # the same, as the docs cite it

The scenarios run on pdserve.testbed.faults, the harness the tests assert with.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from pdserve.bench.report import (
    add_docs_dir_flag,
    default_docs_dir,
    environ,
    markdown_table,
    save_json,
    write_section,
)
from pdserve.common.node.cli import parser
from pdserve.testbed import faults as fh
from pdserve.testbed import kvfaults
from pdserve.tiny_model import make_tiny_model


def kill(name: str):
    return lambda cluster: cluster.procs[name].kill()


def stall(name: str, seconds: float):
    def fault(cluster) -> None:
        pid = cluster.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    return fault


def term(name: str):
    return lambda cluster: cluster.procs[name].send_signal(signal.SIGTERM)


QUEUE_10 = ("--max-queued-requests", "10")


def scenarios() -> list[tuple[str, dict, dict]]:
    """(name, cluster kwargs, run kwargs)"""
    small = {"num_prefill": 1, "num_decode": 1}
    return [
        ("no fault (2P2D)", {}, {}),
        ("kill -9 prefill0 at 0.8 s (2P2D)", {}, {"fault": kill("prefill0"), "fault_after_s": 0.8}),
        ("kill -9 decode0 at 2 s (2P2D)", {}, {"fault": kill("decode0"), "fault_after_s": 2.0}),
        (
            "SIGSTOP decode1 for 3 s (2P2D)",
            {},
            {"fault": stall("decode1", 3.0), "fault_after_s": 1.5},
        ),
        ("SIGTERM decode0 at 1 s (1P2D)", {"num_prefill": 1}, {"fault": term("decode0")}),
        ("KV frames: 3% dropped (1P1D)", {**small, "env": "drop=0.03,seed=1"}, {}),
        ("KV frames: 3% corrupted (1P1D)", {**small, "env": "corrupt=0.03,seed=2"}, {}),
        ("KV frames: 20% delayed 20 ms (1P1D)", {**small, "env": "delay=0.2,delay_s=0.02"}, {}),
        ("30% of clients disconnect (1P1D)", small, {"disconnect_fraction": 0.3}),
        (
            "10x overload, queue 10 (1P1D)",
            {**small, "router_extra": QUEUE_10},
            {},
        ),
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("pdserve bench reliability", __doc__.split("\n\n")[0])
    run = p.add_argument_group("run")
    run.add_argument(
        "--requests", type=int, default=fh.NUM_REQUESTS, help="greedy requests per scenario"
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="the Markdown page of the section (default: DOCS/reliability.md)",
    )
    add_docs_dir_flag(out, "reliability.md and bench/reliability.json")
    args = p.parse_args(argv)
    args.docs_dir = args.docs_dir or default_docs_dir()
    args.out = args.out or args.docs_dir / "reliability.md"
    return args


def measure(
    model: str,
    prompts: list[list[int]],
    wants: list[list[int]],
    scenario: tuple[str, dict, dict],
) -> dict:
    """One scenario on a fresh cluster: its summary, and the blocks its nodes still held."""
    name, cluster_kw, run_kw = scenario
    cluster_kw = dict(cluster_kw)
    fault_kv = cluster_kw.pop("env", "") or None
    with environ(kvfaults.child_env(fault_kv)), fh.cluster_for(model, **cluster_kw) as cluster:
        run = fh.run_scenario(name, cluster, prompts, wants, **run_kw)
        reports = fh.wait_clean(cluster)
    leaked = sum(
        r["report"]["num_blocks"] - r["report"]["free_blocks"]
        for r in reports.values()
        if r["report"] is not None
    )
    return {**run.summary(), "leaked_blocks": leaked, "nodes": sorted(reports)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "m", max_position=2048))
    prompts = fh.make_prompts(512, args.requests)
    wants = fh.reference(model, prompts)
    summaries = []
    for scenario in scenarios():
        summaries.append(measure(model, prompts, wants, scenario))
        print(summaries[-1], flush=True)
    save_json(args.docs_dir / "bench" / "reliability.json", {"scenarios": summaries})
    rows = [
        [
            s["scenario"],
            s["requests"],
            s["ok"],
            s["error"],
            s["disconnected"],
            s["wrong"],
            s["failovers"],
            s["leaked_blocks"],
            f"{s['recovery_s']:.1f}",
        ]
        for s in summaries
    ]
    header = ["scenario", "requests", "ok", "explicit error", "left", "wrong", "failovers"]
    header += ["leaked blocks", "recovery s"]
    body = (
        f"`python scripts/reliability_report.py` ({args.requests} greedy requests at once, "
        f"{fh.MAX_TOKENS} tokens each, tiny Llama, zmq connector, router heartbeat timeout "
        "1.5 s, lease timeout 6 s).\n\n" + markdown_table(header, rows)
    )
    write_section("reliability", body, args.out)


if __name__ == "__main__":
    main()

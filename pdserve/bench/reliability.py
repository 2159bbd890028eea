"""`pdserve bench reliability`: the fault-injection scenarios of tests/e2e/test_faults.py (on
pdserve.testbed.faults, the harness the tests assert with) run once more; what happened to each
request, and how long recovery took, into docs/reliability.md."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.report import (
    add_flags,
    default_docs_dir,
    docs_dir_flag,
    environ,
    records_table,
    save_json,
    write_section,
)
from pdserve.common.node.cli import parser
from pdserve.testbed import faults as fh
from pdserve.testbed import kvfaults
from pdserve.tiny_model import make_tiny_model

QUEUE_10 = ("--max-queued-requests", "10")
SMALL = {"num_prefill": 1, "num_decode": 1}
REQUESTS_FLAG = ("--requests", int, fh.NUM_REQUESTS, "greedy requests per scenario")
OUT_FLAG = (
    "--out",
    Path,
    None,
    "the Markdown page (default: DOCS/reliability.md)",
    {"metavar": "FILE"},
)
COLUMNS = [
    ("scenario", "scenario"),
    ("requests", "requests"),
    ("ok", "ok"),
    ("explicit error", "error"),
    ("left", "disconnected"),
    ("wrong", "wrong"),
    ("failovers", "failovers"),
    ("leaked blocks", "leaked_blocks"),
    ("recovery s", lambda s: f"{s['recovery_s']:.1f}"),
]


def signal_fault(name: str, sig: signal.Signals, hold_s: float = 0.0) -> Callable[[Any], None]:
    """Send `sig` to one process of the cluster; a SIGSTOP is held hold_s, then SIGCONT."""

    def fault(cluster: Any) -> None:
        pid = cluster.procs[name].pid
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            time.sleep(hold_s)
            os.kill(pid, signal.SIGCONT)

    return fault


def scenarios() -> list[tuple[str, dict, dict]]:
    """(name, cluster kwargs, run kwargs); cluster kwarg "env" sets the KV frame faults."""
    kill, stop, term = signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM
    return [
        ("no fault (2P2D)", {}, {}),
        ("kill -9 prefill0 at 0.8 s (2P2D)", {},
         {"fault": signal_fault("prefill0", kill), "fault_after_s": 0.8}),
        ("kill -9 decode0 at 2 s (2P2D)", {},
         {"fault": signal_fault("decode0", kill), "fault_after_s": 2.0}),
        ("SIGSTOP decode1 for 3 s (2P2D)", {},
         {"fault": signal_fault("decode1", stop, 3.0), "fault_after_s": 1.5}),
        ("SIGTERM decode0 at 1 s (1P2D)", {"num_prefill": 1},
         {"fault": signal_fault("decode0", term)}),
        ("KV frames: 3% dropped (1P1D)", {**SMALL, "env": "drop=0.03,seed=1"}, {}),
        ("KV frames: 3% corrupted (1P1D)", {**SMALL, "env": "corrupt=0.03,seed=2"}, {}),
        ("KV frames: 20% delayed 20 ms (1P1D)", {**SMALL, "env": "delay=0.2,delay_s=0.02"}, {}),
        ("30% of clients disconnect (1P1D)", SMALL, {"disconnect_fraction": 0.3}),
        ("10x overload, queue 10 (1P1D)", {**SMALL, "router_extra": QUEUE_10}, {}),
    ]  # fmt: skip


def measure(model: str, prompts: list, wants: list, scenario: tuple[str, dict, dict]) -> dict:
    """One scenario on a fresh cluster: its summary, and the blocks its nodes still held."""
    name, cluster_kw, run_kw = scenario
    fault_kv = cluster_kw.get("env") or None
    cluster_kw = {k: v for k, v in cluster_kw.items() if k != "env"}
    with environ(kvfaults.child_env(fault_kv)), fh.cluster_for(model, **cluster_kw) as cluster:
        run = fh.run_scenario(name, cluster, prompts, wants, **run_kw)
        reports = fh.wait_clean(cluster)
    held = [r["report"] for r in reports.values() if r["report"] is not None]
    leaked = sum(r["num_blocks"] - r["free_blocks"] for r in held)
    return {**run.summary(), "leaked_blocks": leaked, "nodes": sorted(reports)}


def main(argv: list[str] | None = None) -> None:
    p = parser("pdserve bench reliability", __doc__.split("\n\n")[0])
    add_flags(p.add_argument_group("run"), [REQUESTS_FLAG])
    out = p.add_argument_group("output")
    add_flags(out, [OUT_FLAG, docs_dir_flag("reliability.md and bench/reliability.json")])
    args = p.parse_args(argv)
    docs = args.docs_dir or default_docs_dir()
    model = str(make_tiny_model("llama", Path(tempfile.mkdtemp()) / "m", max_position=2048))
    prompts = fh.make_prompts(512, args.requests)
    wants = fh.reference(model, prompts)
    summaries = []
    for scenario in scenarios():
        summaries.append(measure(model, prompts, wants, scenario))
        print(summaries[-1], flush=True)
    save_json(docs / "bench" / "reliability.json", {"scenarios": summaries})
    body = (
        f"`python scripts/reliability_report.py` ({args.requests} greedy requests at once, "
        f"{fh.MAX_TOKENS} tokens each, tiny Llama, zmq connector, router heartbeat timeout "
        "1.5 s, lease timeout 6 s).\n\n" + records_table(COLUMNS, summaries)
    )
    write_section("reliability", body, args.out or docs / "reliability.md")


if __name__ == "__main__":
    main()

"""`pdserve bench chaos --duration 60` (the CI short form): real `pdserve serve` with 2 prefill
nodes, 2 decode nodes and 2 routers under load while children are killed, stopped and
restarted; no answer wrong, none hung, no block leaked (no timing thresholds). Plus the pure
pieces it is built from: how answers are classified, recovery, the two-router deployment and
the staged --server-src tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.chaos import NODES, Answer, Fault, answer, recovery_s, stage_source
from pdserve.bench.load import RequestResult
from pdserve.local_cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]


def start_short_run(out: Path) -> subprocess.Popen:
    """The run, begun by tests/conftest.py after collection: it goes on beside the rest of the
    suite, so its clients wait a second after each answer (eight clients, a few requests in
    flight at each fault) rather than take the two cores from the other tests."""
    # Every 8 s: seed 0's first faults stop decode1, router0 and decode0 and restart prefill1.
    cmd = [sys.executable, "-m", "pdserve", "bench", "chaos", "--duration", "60", "--interval"]
    cmd += ["8", "--think-s", "1", "--request-timeout", "60", "--out", str(out)]
    with (out / "output.log").open("w") as log:  # the child holds its own copy
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


# with_args: a mark called with a function alone would take it for the function it marks.
READS_THE_RUN = pytest.mark.background.with_args(start_short_run)


@pytest.fixture(scope="module")
def short_run(background_runs: dict) -> tuple[Path, dict[str, Any], str]:
    proc, out = background_runs[start_short_run]
    proc.wait(timeout=600)
    output = (out / "output.log").read_text()
    assert proc.returncode == 0, output[-6000:]
    return out, json.loads((out / "chaos.json").read_text()), output


@READS_THE_RUN
def test_no_answer_wrong_or_hung_and_no_block_leaked(short_run) -> None:
    _, run, _ = short_run
    assert run["wrong"] == 0, run["errors"]
    assert run["hung"] == 0, run["errors"]
    assert run["leaked_blocks"] == 0 and run["leaked_requests"] == 0, run["integrity"]
    assert run["nodes_unchecked"] == 0 and set(run["integrity"]) == set(NODES)
    assert [g["status"] for g in run["goals"]] == ["met"] * 3


@READS_THE_RUN
def test_faults_hit_every_role_and_answers_come_after(short_run) -> None:
    _, run, stdout = short_run
    assert run["faults_injected"] >= 3
    assert run["roles_hit"] == ["decode", "prefill", "router"]
    assert stdout.count("fault ") >= run["faults_injected"]
    assert run["correct_after_last_fault"] > 0
    hit = [f for f in run["faults"] if f["pid"] is not None]
    assert any(f["recovery_s"] is not None for f in hit)


@READS_THE_RUN
def test_counts_add_up_and_the_section_is_written(short_run) -> None:
    out, run, _ = short_run
    outcomes = ("correct", "error", "dropped", "wrong", "hung")
    assert run["sent"] == sum(run[o] for o in outcomes) > 0
    assert len(run["not_correct"]) == run["sent"] - run["correct"]
    assert run["availability"] == pytest.approx(run["correct"] / run["sent"])
    page = (out / "reliability.md").read_text()
    assert page.count("<!-- BEGIN chaos -->") == 1 and page.count("<!-- END chaos -->") == 1
    assert "| wrong = 0 | 0 |" in page
    assert run["command"].startswith("python scripts/bench_chaos.py --duration 60")


def result(**fields: Any) -> RequestResult:
    return RequestResult(start=10.0, e2e=2.0, **fields)


def test_answers_are_classified_by_what_came_back() -> None:
    ok = dict(success=True, status=200, finish_reason="length", text="abc")
    assert answer("router0", result(**ok), "abc").outcome == "correct"
    assert answer("router0", result(**ok), "abd").outcome == "wrong"
    assert answer("router0", result(**{**ok, "finish_reason": "stop"}), "abc").outcome == "wrong"
    failed = result(success=True, status=200, finish_reason="error", text="ab")
    assert answer("router1", failed, "abc").outcome == "error"
    assert answer("router1", result(status=503, error="HTTP 503: busy"), "x").outcome == "error"
    cut = result(status=200, error="stream ended without [DONE] or usage")
    assert answer("router1", cut, "x").outcome == "dropped"
    assert answer("router1", result(error="ConnectError: refused"), "x").outcome == "dropped"
    late = answer("router1", result(error="timed out after 60s"), "x")
    assert (late.outcome, late.start, late.end) == ("hung", 10.0, 12.0)


def test_recovery_waits_for_the_last_failure_through_the_role_before_the_next_fault() -> None:
    answers = [
        Answer("router0", 4.0, 9.0, "correct", ""),  # sent before the faults
        Answer("router0", 5.2, 5.4, "correct", ""),  # before a failure: not recovered yet
        Answer("router0", 5.5, 6.0, "error", "HTTP 503"),
        Answer("router1", 6.0, 7.0, "correct", ""),
        Answer("router0", 7.0, 8.5, "correct", ""),
    ]
    assert recovery_s(Fault(5.0, "decode0", "kill", 123), 20.0, answers) == pytest.approx(2.0)
    assert recovery_s(Fault(5.0, "router0", "kill", 123), 20.0, answers) == pytest.approx(3.5)
    # A failure that ends after the next fault may be that fault's doing: not counted.
    assert recovery_s(Fault(5.0, "router0", "kill", 123), 5.8, answers) == pytest.approx(0.4)
    assert recovery_s(Fault(5.0, "router0", "kill", 123), 6.1, answers) == pytest.approx(3.5)
    assert recovery_s(Fault(7.5, "router1", "stop", 123, 3.0), 20.0, answers) is None


def test_every_node_registers_with_each_router() -> None:
    cluster = LocalCluster("m", 2, 2, num_routers=2, port=9000, control_port=9001)
    children = cluster.children()
    assert [n for n in children if n.startswith("router")] == ["router", "router1"]
    (port, control) = cluster.more_routers[0]
    assert children["router1"][children["router1"].index("--control-port") + 1] == str(control)
    assert cluster.urls == ["http://127.0.0.1:9000", f"http://127.0.0.1:{port}"]
    for name in cluster.node_names:
        argv = children[name]
        routers = [argv[i + 1] for i, a in enumerate(argv) if a == "--router"]
        assert routers == ["127.0.0.1:9001", f"127.0.0.1:{control}"], name


def test_server_src_is_staged_as_installed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for folder in ("pdserve", "common", "router"):
        (src / folder).mkdir(parents=True)
        (src / folder / "__init__.py").write_text(f"WHERE = {folder!r}\n")
    pyproject = '"pdserve" = "pdserve"\n"pdserve.common" = "common"\n"pdserve.router" = "router"\n'
    (src / "pyproject.toml").write_text(pyproject)
    staged = stage_source(src, tmp_path / "stage") / "pdserve"
    assert sorted(p.name for p in staged.iterdir()) == ["__init__.py", "common", "router"]
    assert (staged / "common").resolve() == (src / "common").resolve()
    code = "import pdserve.common as c, pdserve.router as r; print(c.WHERE, r.WHERE)"
    env = {"PYTHONPATH": str(staged.parent), "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert got.stdout.split() == ["common", "router"], got.stderr

"""pdserve.bench.report: each benchmark rewrites only its own section of the page, outputs go
to the docs folder it is given (never site-packages), and the shared helpers; `pdserve bench`
lists and runs the benchmarks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pdserve.bench import report as _report
from pdserve.bench import systems


def test_first_section_creates_the_page(tmp_path: Path) -> None:
    doc = tmp_path / "sub" / "benchmarks.md"
    _report.write_section("a", "alpha body\n\n", doc)
    assert doc.read_text() == "# Benchmarks\n\n<!-- BEGIN a -->\nalpha body\n<!-- END a -->\n"


def test_replace_keeps_prose_and_other_sections(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nIntro prose.\n")
    _report.write_section("a", "alpha v1", doc)
    with doc.open("a") as f:
        f.write("\nProse between the sections.\n")
    _report.write_section("b", "beta v1", doc)
    doc.write_text(doc.read_text() + "\nClosing prose.\n")

    _report.write_section("a", "alpha v2\nsecond line", doc)
    _report.write_section("b", "beta v2", doc)

    assert doc.read_text() == (
        "# Benchmarks\n\nIntro prose.\n\n"
        "<!-- BEGIN a -->\nalpha v2\nsecond line\n<!-- END a -->\n"
        "\nProse between the sections.\n\n"
        "<!-- BEGIN b -->\nbeta v2\n<!-- END b -->\n"
        "\nClosing prose.\n"
    )


def test_rewriting_the_same_body_is_idempotent(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    _report.write_section("a", "same", doc)
    _report.write_section("offline", "x", doc)
    first = doc.read_text()
    _report.write_section("a", "same", doc)
    assert doc.read_text() == first


def test_a_name_that_prefixes_another_touches_only_its_own(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    _report.write_section("kv", "short", doc)
    _report.write_section("kv_transfer", "long", doc)
    _report.write_section("kv", "short v2", doc)
    text = doc.read_text()
    assert "short v2" in text and "long" in text and "short\n" not in text


@pytest.mark.parametrize(
    "page",
    [
        "<!-- BEGIN a -->\nno end\n",
        "<!-- END a -->\n<!-- BEGIN a -->\n",
        "<!-- BEGIN a -->\n<!-- END a -->\n<!-- BEGIN a -->\n<!-- END a -->\n",
    ],
)
def test_broken_markers_are_refused_and_the_page_kept(tmp_path: Path, page: str) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(page)
    with pytest.raises(ValueError, match="'a'"):
        _report.write_section("a", "body", doc)
    assert doc.read_text() == page


def test_save_json_makes_folders_and_round_trips(tmp_path: Path) -> None:
    path = _report.save_json(tmp_path / "x" / "y.json", {"b": [1, 2.5], "a": "z"})
    assert json.loads(path.read_text()) == {"a": "z", "b": [1, 2.5]}


def test_markdown_table() -> None:
    table = _report.markdown_table(["n", "v"], [[1, 0.012345], ["x", 123456.0]])
    assert table.splitlines() == ["| n | v |", "|---|---|", "| 1 | 0.0123 |", "| x | 123,456 |"]


def test_machine_names_the_software() -> None:
    info = _report.machine()
    assert info["torch"] and info["python"] and info["threads"] >= 1


def test_pdserve_bench_lists_and_runs_the_benchmarks() -> None:
    import subprocess

    top = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "--help"], capture_output=True, text=True
    )
    assert top.returncode == 0
    for name in ("serve", "kv-transfer", "offline", "compare", "kernels", "reliability"):
        assert f"  {name} " in top.stdout, name
    one = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "offline", "--help"],
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0 and one.stdout.startswith("usage: pdserve bench offline")
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "nope"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "unknown benchmark 'nope'" in bad.stderr


def test_outputs_go_to_docs_by_default_and_elsewhere_keep_their_own_page(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    assert _report.outputs(None, docs) == _report.Outputs(docs / "bench", docs / "benchmarks.md")
    # --out naming DOCS/bench itself is still the docs page
    same = _report.outputs(docs / "x" / ".." / "bench", docs)
    assert same.page == docs / "benchmarks.md"
    trial = _report.outputs(tmp_path / "trial", docs)
    assert trial == _report.Outputs(tmp_path / "trial", tmp_path / "trial" / "benchmarks.md")
    assert _report.outputs(None, docs).link(docs / "bench" / "offline.png") == "bench/offline.png"
    assert trial.link(tmp_path / "trial" / "offline.png") == "offline.png"


def test_default_docs_dir_is_the_checkout_else_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = Path(__file__).resolve().parents[2]
    assert _report.checkout_root() == checkout  # the tests run from a checkout
    assert _report.default_docs_dir() == checkout / "docs"
    monkeypatch.setattr(_report, "checkout_root", lambda: None)  # as an installed wheel
    monkeypatch.chdir(tmp_path)
    assert _report.default_docs_dir() == tmp_path / "docs"


def test_quick_runs_must_name_their_out(tmp_path: Path) -> None:
    from pdserve.bench import offline

    with pytest.raises(SystemExit) as exc:
        offline.parse_args(["--quick"])
    assert exc.value.code == 2
    args = offline.parse_args(["--quick", "--out", str(tmp_path), "--docs-dir", "d"])
    assert args.outputs == _report.Outputs(tmp_path, tmp_path / "benchmarks.md")
    assert args.cache_dir == tmp_path / "models"
    args = offline.parse_args(["--docs-dir", str(tmp_path)])
    assert args.outputs == _report.Outputs(tmp_path / "bench", tmp_path / "benchmarks.md")


def test_save_json_writes_inf_and_nan_as_strings(tmp_path: Path) -> None:
    path = _report.save_json(tmp_path / "r.json", {"x": [float("inf"), float("nan"), 1.0]})
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"x": ["inf", "nan", 1.0]}


def test_environ_sets_unsets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("PDSERVE_T_KEEP", "old")
    monkeypatch.delenv("PDSERVE_T_NEW", raising=False)
    with systems.environ({"PDSERVE_T_KEEP": None, "PDSERVE_T_NEW": "1"}):
        assert "PDSERVE_T_KEEP" not in os.environ and os.environ["PDSERVE_T_NEW"] == "1"
    assert os.environ["PDSERVE_T_KEEP"] == "old" and "PDSERVE_T_NEW" not in os.environ


def test_best_time_warms_up_then_keeps_the_fastest_call() -> None:
    calls = []
    best = _report.best_time(lambda: calls.append(1), "cpu", repeats=4)
    assert len(calls) == 5 and 0 <= best < 1


def test_a_cached_model_of_the_same_spec_is_reused(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / _report.MODEL_STAMP).write_text(json.dumps({"layers": 3}))
    assert _report.cached_model(tmp_path, "m", {"layers": 3}) == out  # nothing built


def test_every_benchmark_groups_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    from pdserve.bench import BENCHMARKS, main

    for name, (module, _) in BENCHMARKS.items():
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        text = capsys.readouterr().out
        assert exc.value.code == 0 and text.startswith(f"usage: pdserve bench {name}"), name
        assert "\noutput:\n" in text, name
        assert importlib.import_module(f"pdserve.bench.{module.split(':')[0]}").__doc__, name


def test_goals_are_met_missed_or_not_measured_and_tabled() -> None:
    goals = [
        _report.goal("faster", 3.0, 2.0, ">=", 1.5),
        _report.goal("smaller", 3.0, 2.0, "<=", 1.0),
        _report.goal("unmeasured", None, 2.0, ">=", 1.0),
    ]
    assert [g["status"] for g in goals] == ["met", "missed", "not measured"]
    assert goals[0]["ratio"] == 1.5 and goals[2]["ratio"] is None
    assert _report.goals_table(goals).splitlines()[2:] == [
        "| faster | 3 | 2 | 1.5 | met |",
        "| smaller | 3 | 2 | 1.5 | missed |",
        "| unmeasured | — | 2 | — | not measured |",
    ]


def test_a_records_progress_line_uses_its_tables_columns() -> None:
    columns = [("batch", "batch"), ("tok/s", lambda r: r["n"] / r["s"])]
    record = {"batch": 4, "n": 3000, "s": 2.0}
    assert _report.record_line(columns, record) == "batch 4, tok/s 1,500"
    assert _report.records_table(columns, [record]).splitlines()[-1] == "| 4 | 1,500 |"


def test_a_run_records_its_command_and_machine_or_is_read_back(tmp_path: Path) -> None:
    import argparse

    measure = lambda: {"device": "cpu"}  # noqa: E731
    run = _report.measure_or_load(argparse.Namespace(), "x", "bench_x.py", ["--quick"], measure)
    assert run["command"] == "python scripts/bench_x.py --quick" and run["device"] == "cpu"
    assert run["benchmark"] == "x" and len(run["load_avg"]) == 2 and run["machine"]["torch"]
    saved = _report.save_json(tmp_path / "x.json", {**run, "repeats": 3})
    args = argparse.Namespace(from_json=saved)
    again = _report.measure_or_load(args, "x", "bench_x.py", [], pytest.fail)  # measures nothing
    assert again == json.loads(saved.read_text())
    header = _report.run_header(again)
    assert header[0] == "Command: `python scripts/bench_x.py --quick`  "
    assert "device `cpu`; median of 3 repeats" in header[1]

"""scripts/_report.py: each benchmark rewrites only its own section of the page."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pdserve.bench import report as _report


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

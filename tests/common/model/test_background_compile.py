"""Decode packages compiled in the background (common/engine/background_compile.py): the engine
serves eager at once, a bucket switches to its package between two steps with eager's greedy
tokens, a second start loads it and compiles nothing, and a child that fails or is killed
leaves the bucket eager and no unfinished package behind.

One real background compile serves this module and tests/common/model/test_gguf_compile.py
(`gguf_switch`, tests/common/model/conftest.py: bucket 1 of the tiny Llama as a Q4_1 GGUF,
cold, under a root of its own; the suite's one cold compile of it); the failing children are
stand-ins that exit at once."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.common.engine.background_compile import BackgroundCompile, CompileJob, tmp_package_path
from pdserve.common.engine.config import EAGER_ENV
from pdserve.common.engine.llm import LLM

# one_thread: this module's engines, and so the child's packages, at one thread (autouse).
from tests.common.model.test_compile import (  # noqa: F401
    COMPILE_WAIT_S,
    QWEN2_SLIDING,
    one_thread,
    waits_for_a_compile,
)
from tests.common.test_llm_equivalence import GREEDY, PROMPTS, hf_greedy
from tests.devices import ON_CUDA

# The modules that read `gguf_switch` (tests/common/model/conftest.py) are one xdist group: on
# one worker, which compiles it once.
SHARES_GGUF_SWITCH = pytest.mark.xdist_group("gguf_switch")
pytestmark = [
    pytest.mark.skipif(ON_CUDA, reason="background compiles make CPU packages"),
    SHARES_GGUF_SWITCH,
]

PROMPT = 4  # PROMPTS[4]: 40 tokens, greedy for MAX_TOKENS (10)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("qwen2", **QWEN2_SLIDING))


def start(model_dir: str, root: Path, max_num_seqs: int = 1) -> LLM:
    return LLM(model_dir, compile_mode="background", max_num_seqs=max_num_seqs, dtype="float32",
               compile_cache_dir=str(root), skip_tokenizer_init=True)  # fmt: skip


def tokens(llm: LLM) -> list[int]:
    (out,) = llm.generate([PROMPTS[PROMPT]], GREEDY)
    return list(out.token_ids)


@dataclass(frozen=True, slots=True)
class Switch:
    """One request decoded across a background compile: its tokens, per decode step whether it
    ran compiled, and eager's tokens for it; the engine (still open), its model and its root."""

    llm: LLM
    tokens: list[int]
    compiled_steps: list[bool]
    eager_tokens: list[int]
    model: str
    root: Path


@contextlib.contextmanager
def switch_mid_stream(model: str, root: Path) -> Iterator[Switch]:
    """Decode two steps eager while bucket 1 compiles, wait for the compile, decode the rest."""
    with LLM(model, compile_mode="eager", max_num_seqs=1, dtype="float32",
             skip_tokenizer_init=True) as eager:  # fmt: skip
        want = tokens(eager)
    with start(model, root) as llm:
        compiled, engine = llm.engine.runner.compiled, llm.engine
        assert compiled is not None and compiled.background is not None and not compiled.packages
        steps: list[bool] = []
        runs = compiled.runs
        compiled.runs = lambda batch: steps.append(runs(batch)) or steps[-1]
        request = engine.add_request("r", PROMPTS[PROMPT], GREEDY)
        while len(steps) < 2:
            engine.step()
        assert compiled.background.wait(COMPILE_WAIT_S), "the background compile did not finish"
        while engine.has_unfinished:
            engine.step()
        engine.check_integrity()
        compiled.runs = runs
        yield Switch(llm, list(request.output_token_ids), list(steps), want, model, root)


@waits_for_a_compile
def test_a_bucket_switches_to_its_package_mid_stream_with_the_same_tokens(
    gguf_switch: Switch,
) -> None:
    assert gguf_switch.tokens == gguf_switch.eager_tokens
    steps = gguf_switch.compiled_steps
    assert steps[:2] == [False, False] and steps[-1], steps  # eager, then compiled
    assert steps == sorted(steps), "a bucket switched back to eager"


@waits_for_a_compile
def test_a_second_start_compiles_nothing(gguf_switch: Switch) -> None:
    with start(gguf_switch.model, gguf_switch.root) as llm:
        compiled = llm.engine.runner.compiled
        assert compiled.background is None, "a second start compiled again"
        assert sorted(compiled.packages) == [1]
        counts = compiled.cache_counts
        assert (counts.hits, counts.misses) == (1, 0)
        assert tokens(llm) == gguf_switch.eager_tokens
    assert not list(gguf_switch.root.rglob("*.tmp-*")), "an unfinished package was left"


def _dying_child(how: str, started: list[int]) -> object:
    """A stand-in child that writes its unfinished package, then dies (`kill`) or exits 1."""
    end = "os.kill(os.getpid(), signal.SIGKILL)" if how == "kill" else "sys.exit(1)"

    def command(self: BackgroundCompile, job: CompileJob) -> list[str]:
        started.append(job.size)
        folder = Path(job.cache_root) / job.digest
        code = (
            "import os, signal, sys\n"
            f"open({str(folder)!r} + f'/decode-{job.size}.tmp-{{os.getpid()}}.pt2', 'w')\n"
            f"{end}\n"
        )
        return [sys.executable, "-c", code]

    return command


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_failed_compile_leaves_eager_serving_and_no_tmp_files(
    how: str, model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    monkeypatch.setattr(BackgroundCompile, "command", _dying_child(how, started))
    with start(model_dir, tmp_path, max_num_seqs=2) as llm:
        background = llm.engine.runner.compiled.background
        assert background.wait(60)
        # the smallest bucket first; its failure leaves the other eager without a child
        assert started == [1] and background.failed == [1, 2] and background.compiled == []
        folder = llm.engine.runner.compiled.cache.path
        pid = background.child.pid
        assert not tmp_package_path(folder, 1, pid).exists(), "the unfinished package stayed"
        (out,) = llm.generate([PROMPTS[PROMPT]], GREEDY)
        assert out.token_ids == hf_greedy(model_dir)[0][PROMPT]
        assert not llm.engine.runner.compiled.packages


def test_close_kills_a_compile_in_flight(model_dir: str, tmp_path: Path) -> None:
    llm = start(model_dir, tmp_path)
    background = llm.engine.runner.compiled.background
    deadline = time.monotonic() + 60
    while background.child is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child = background.child
    assert child is not None
    llm.close()
    assert not background.running and child.returncode is not None
    assert background.compiled == [] and not list(tmp_path.rglob("*.tmp-*"))


def test_the_suite_starts_no_background_compile(model_dir: str) -> None:
    """tests/conftest.py's PDSERVE_ENFORCE_EAGER=1: an engine that does not ask stays eager."""
    assert os.environ.get(EAGER_ENV) == "1"
    with LLM(model_dir, skip_tokenizer_init=True) as llm:
        assert llm.engine.runner.compiled is None


def test_a_compile_job_crosses_to_the_child_as_json(model_dir: str) -> None:
    from pdserve.common.engine.config import ModelConfig

    job = CompileJob(ModelConfig(model_dir), '{"buckets": [1]}', "/r", "abc", 1, 4)
    assert CompileJob.from_json(job.to_json()) == job


def test_the_compile_mode_flag_reaches_the_config_and_serve_passes_it_on() -> None:
    import argparse

    from pdserve.common.node.cli import add_engine_args, engine_configs
    from pdserve.serve import _engine_flags, build_parser

    flags = ["--compile-mode", "background"]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(flags)
    args.model = "m"
    assert engine_configs(args)[0].compile_mode == "background"
    assert _engine_flags(build_parser().parse_args(["m", *flags])) == flags
    with pytest.raises(SystemExit):  # argparse's usage error
        parser.parse_args(["--compile-mode", "lazy"])


def test_the_compile_child_runs_at_nice_19_whatever_its_parent_runs_at() -> None:
    """A node started at nice -10 (a benchmark's) must not hand its compile child nice 9."""
    import subprocess

    code = (
        "import os; from pdserve.common.engine.compile_child import _lowest_priority; "
        "_lowest_priority(); print(os.getpriority(os.PRIO_PROCESS, 0))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, -10),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    except subprocess.SubprocessError as e:
        if "Permission" in str(getattr(e, "stderr", "")) or os.geteuid() != 0:
            pytest.skip("raising a process's priority needs root")
        raise
    assert out.stdout.strip() == "19"

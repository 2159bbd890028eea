"""A tensor-parallel engine (rank 0 here, its workers as processes on gloo): greedy output
equal to HF transformers', sampling and prompt logprobs as at TP 1, and a group that fails as
one when a rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import ClassVar

import pytest

from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.engine.tensor_parallel import GroupBroken
from pdserve.common.wire.messages import Message
from pdserve.common.wire.ranks import Done, Handlers, RankCommand, RankCommandError, RankPlane
from pdserve.tiny_model import make_tiny_model
from tests.common.test_llm_equivalence import GREEDY, PROMPTS, VOCAB, hf_greedy

# Each rank on one thread: two cores hold two ranks; four ranks share them.
TP = {"skip_tokenizer_init": True, "threads_per_rank": 1, "dtype": "float32"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {
        "llama": str(make_tiny_model("llama", root / "llama", vocab=VOCAB, kv_heads=4)),
        # 2 KV heads on 4 ranks: each KV head replicated on two of them.
        "qwen3": str(make_tiny_model("qwen3", root / "qwen3", vocab=VOCAB, kv_heads=2)),
    }


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# Qwen3 at TP 4 over 2 KV heads: heads split and replicated, q/k norms per head. Llama at TP 2
# is covered by tests/common/model/test_parallel.py (logits) and test_tp_nodes.py (greedy).
@pytest.mark.parametrize(("arch", "size"), [("qwen3", 4)])
def test_greedy_equals_hf_and_sampling_equals_tp1(model_dirs, arch: str, size: int) -> None:
    model_dir = model_dirs[arch]
    hf_tokens, _ = hf_greedy(model_dir)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=7, logprobs=2)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    short = PROMPTS[:4]
    one = LLM(model_dir, skip_tokenizer_init=True, dtype="float32")
    with LLM(model_dir, tensor_parallel_size=size, **TP) as llm:
        workers = [p.pid for p in llm.engine.runner.driver.procs]
        # The rendezvous and gloo's pairs on loopback only: every socket of a worker (a fresh
        # process), and here (where other tests' sockets may live) the rendezvous's listener.
        loopback = {"127.0.0.1", "::1"}
        for pid in workers:
            assert _tcp_local_addresses(pid) <= loopback
        store_port = llm.engine.runner.driver._store.port
        assert _tcp_local_addresses(os.getpid(), store_port) <= loopback
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_tokens
        for a, b in zip(one.generate(short, seeded), llm.generate(short, seeded), strict=True):
            assert a.token_ids == b.token_ids
            assert _same_tops(a.logprobs, b.logprobs)
        for a, b in zip(one.generate(short, scored), llm.generate(short, scored), strict=True):
            assert [p.token_id for p in a.prompt_logprobs[1:]] == [
                p.token_id for p in b.prompt_logprobs[1:]
            ]
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
        llm.engine.check_integrity()
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, workers)), "a worker outlived close()"


def _tcp_local_addresses(pid: int, port: int | None = None) -> set[str]:
    """The local addresses of every TCP socket process `pid` holds (from /proc), or of those
    on local `port` only."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                address, local_port = cols[1].split(":")
                if cols[9] in inodes and port in (None, int(local_port, 16)):
                    found.add(_proc_address(address, width))
    assert found, f"process {pid} holds no TCP socket (the check would prove nothing)"
    return found


def _proc_address(hex_ip: str, width: int) -> str:
    """/proc/net/tcp's address (32-bit words in host order) as text."""
    import ipaddress

    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
    address = ipaddress.ip_address(words)
    return str(getattr(address, "ipv4_mapped", None) or address)


def _same_tops(a, b) -> bool:
    return all(
        [t for t, _ in x.top] == [t for t, _ in y.top]
        and all(abs(p - q) < 1e-4 for (_, p), (_, q) in zip(x.top, y.top, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def test_a_dead_worker_fails_the_next_step_naming_it(model_dirs) -> None:
    with LLM(model_dirs["llama"], tensor_parallel_size=2, **TP) as llm:
        assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
        worker = llm.engine.runner.driver.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        assert llm.engine.broken() == "rank 1 exited with -9"  # a node's loop checks this
        with pytest.raises(GroupBroken, match="rank 1 exited with -9"):
            llm.generate([[1, 2, 3]], GREEDY)


_RANK0 = """
import sys, time
from pdserve.common.engine.llm import LLM
llm = LLM(sys.argv[1], skip_tokenizer_init=True, tensor_parallel_size=2, threads_per_rank=1)
print(llm.engine.runner.driver.procs[0].pid, flush=True)
time.sleep(120)
"""


def test_workers_exit_when_rank0_is_killed(model_dirs) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _RANK0, model_dirs["llama"]], stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(child.stdout.readline())
        assert _alive(worker)
    finally:
        child.kill()
        child.wait(timeout=10)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "a worker outlived its rank 0"


def test_a_model_that_cannot_split_is_refused_before_any_process(model_dirs) -> None:
    with pytest.raises(ValueError, match="4 attention heads do not split across 3 ranks"):
        LLM(model_dirs["llama"], tensor_parallel_size=3, **TP)


ECHOES = RankPlane("echo test")


@dataclass(frozen=True, slots=True)
class Echoed(Message):
    TYPE: ClassVar[str] = "echo.echoed"
    rank: int
    tag: str
    value: int


@ECHOES.command
@dataclass(frozen=True, slots=True)
class Echo(RankCommand):
    TYPE: ClassVar[str] = "echo.echo"
    REPLY: ClassVar[type[Message]] = Echoed
    value: int


@ECHOES.command
@dataclass(frozen=True, slots=True)
class Fail(RankCommand):
    TYPE: ClassVar[str] = "echo.fail"
    REPLY: ClassVar[type[Message]] = Done


@dataclass(frozen=True, slots=True)
class Unheard(RankCommand):
    """A command of no agent's plane."""

    TYPE: ClassVar[str] = "echo.unheard"
    REPLY: ClassVar[type[Message]] = Done


class EchoAgent:
    """A rank agent for the call test: answers with its rank, or fails on demand."""

    PLANE = ECHOES

    def __init__(self, runner, group, tag: str) -> None:
        self.rank, self.tag = group.rank, tag

    def handlers(self) -> Handlers:
        return {Echo: self.echo, Fail: self.fail}

    def echo(self, cmd: Echo) -> Echoed:
        return Echoed(self.rank, self.tag, cmd.value)

    def fail(self, cmd: Fail) -> Done:
        raise ValueError("asked to")


def test_rank0_calls_every_ranks_agent(model_dirs, monkeypatch) -> None:
    from pathlib import Path

    from pdserve.common.engine.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from pdserve.common.engine.llm_engine import LLMEngine

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    parallel = ParallelConfig(
        2,
        threads_per_rank=1,
        rank_agent=f"{__name__}:EchoAgent",
        rank_agent_options={"tag": "t"},
    )
    engine = LLMEngine(
        ModelConfig(model_dirs["llama"], dtype="float32"),
        CacheConfig(num_blocks=16),
        SchedulerConfig(),
        parallel,
    )
    try:
        driver = engine.runner.driver
        here = Echoed(0, "here", 7)
        assert driver.call(ECHOES, Echo(7), lambda: here) == [here, Echoed(1, "t", 7)]
        with pytest.raises(RankCommandError, match=r"rank 1: echo.fail failed: ValueError: aske"):
            driver.call(ECHOES, Fail(), lambda: Done())
        with pytest.raises(RankCommandError, match="rank 1: echo.unheard failed: malformed"):
            driver.call(ECHOES, Unheard(), lambda: Done())

        def unreachable() -> None:  # rank 0's own part fails (a decode node gone, say)
            raise ConnectionRefusedError("decode node gone")

        # Raised as it is, after the workers' answers: none is left waiting in the gather
        # (which would break the group at the collective's timeout, and the next call with it).
        with pytest.raises(ConnectionRefusedError, match="decode node gone"):
            driver.call(ECHOES, Echo(1), unreachable)
        assert driver.call(ECHOES, Echo(8), lambda: here)[1] == Echoed(1, "t", 8)
        # A failed command leaves the group whole: steps still run on every rank.
        engine.add_request("r", [1, 2, 3], GREEDY)
        while engine.has_unfinished:
            engine.step()
        engine.check_integrity()
    finally:
        engine.close()

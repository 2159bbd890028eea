"""bf16 end to end: a node colocated and a prefill node feeding a decode node over each
connector, both in bf16, answer as the bf16 offline engine does, greedy token for token, with
the same prompt logprobs (the KV crosses the connector in bf16, its checksums verified)."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.llm import LLM, RequestOutput, SamplingParams
from pdserve.common.node.colocated import ColocatedNode
from pdserve.common.node.config import NodeConfig
from pdserve.common.wire.messages import Prefill, Tokens
from tests.common.node.test_tp_nodes import BLOCK, PROMPTS, pair, serve
from tests.prefill_node.test_prefill_node import FakeRouter

BF16 = "bfloat16"
SCORED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from pdserve.tiny_model import make_tiny_model

    return str(make_tiny_model("llama", tmp_path_factory.mktemp("bf16") / "llama", kv_heads=2))


@functools.cache
def offline(model: str) -> list[RequestOutput]:
    """The bf16 offline engine's answers, one prompt at a time in the nodes' token budget."""
    llm = LLM(
        model, block_size=BLOCK, max_num_batched_tokens=40, skip_tokenizer_init=True, dtype=BF16
    )
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    return [llm.generate([p], SCORED)[0] for p in PROMPTS]


def check(got: list[int], first: Tokens, want: RequestOutput) -> None:
    assert got == want.token_ids
    assert list(first.prompt_logprobs) == want.prompt_logprobs[1:]


def test_colocated_in_bf16_equals_the_bf16_engine(model: str) -> None:
    router = FakeRouter()
    cache, sched = (
        CacheConfig(block_size=BLOCK, num_blocks=48),
        SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8),
    )
    node = ColocatedNode(ModelConfig(model, dtype=BF16), cache, sched, NodeConfig((router.addr,)))
    try:
        for i, prompt in enumerate(PROMPTS):
            node.handle(Prefill(f"r{i}", tuple(prompt), SCORED))
            sent = []
            deadline = time.monotonic() + 30
            while not (sent and sent[-1].finish_reason):
                assert time.monotonic() < deadline
                node.step()
                sent += [m for m in router.drain() if isinstance(m, Tokens)]
            check([t for m in sent for t in m.token_ids], sent[0], offline(model)[i])
        node.engine.check_integrity()
    finally:
        node.close()
        router.sock.close()


@pytest.mark.parametrize("connector", ["zmq", "nccl", "shm", "nixl"])
def test_1p1d_in_bf16_equals_the_bf16_engine(model: str, connector: str) -> None:
    with pair(model, 1, 1, connector, dtype=BF16) as (router, prefill, decode_):
        firsts: dict[str, Tokens] = {}
        recv = router.recv

        def recording(kind: type, request_id: str, timeout: float = 10.0):
            msg = recv(kind, request_id, timeout)
            if isinstance(msg, Tokens):
                firsts.setdefault(request_id, msg)
            return msg

        router.recv = recording
        assert prefill.engine.kv_layout().dtype == BF16 == decode_.engine.kv_layout().dtype
        for i, prompt in enumerate(PROMPTS):
            got = serve(router, prefill, decode_, f"r{i}", prompt, 1, SCORED)
            check(got, firsts[f"r{i}"], offline(model)[i])

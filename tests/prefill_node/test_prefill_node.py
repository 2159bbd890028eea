"""The prefill node in-process against a real decode node's zmq receiver.

The test owns the router's ROUTER socket and drives both nodes' handlers and steps by hand, so
it can see the order of the prefill node's compute and sends and break its sender at will.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.common.node.config import NodeConfig
from pdserve.common.wire.messages import (
    Error,
    Failure,
    Heartbeat,
    Message,
    Prefill,
    Reserved,
    ReserveKV,
    SyncPrefixes,
    Tokens,
    decode,
)
from pdserve.common.wire.payloads import StructuredOutputsParams
from pdserve.decode_node.node import DecodeNode
from pdserve.kv_transfer.base import TransferError
from pdserve.prefill_node.node import PrefillNode

BLOCK = 16
SAMPLING = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class FakeRouter:
    """The router's ROUTER socket; collects what nodes send."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"127.0.0.1:{port}"

    def recv(self, kind: type, request_id: str, timeout: float = 10.0) -> Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                _, frame = self.sock.recv_multipart()
                msg = decode(frame)
                if isinstance(msg, kind) and getattr(msg, "request_id", "") == request_id:
                    return msg
        raise AssertionError(f"no {kind.__name__} for {request_id}")

    def drain(self) -> list[Message]:
        out = []
        while self.sock.poll(100):
            out.append(decode(self.sock.recv_multipart()[1]))
        return out


@pytest.fixture()
def nodes(tiny_model_dir) -> Iterator[tuple[FakeRouter, PrefillNode, DecodeNode]]:
    model = ModelConfig(str(tiny_model_dir("llama")), dtype="float32")
    cache = CacheConfig(block_size=BLOCK, num_blocks=64)
    sched = SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8)
    router = FakeRouter()
    node = NodeConfig(router_addrs=(router.addr,))
    prefill = PrefillNode(model, cache, sched, node)
    decode_ = DecodeNode(model, cache, sched, node)
    yield router, prefill, decode_
    prefill.close()
    decode_.close()
    router.sock.close()


def start(
    router,
    prefill,
    decode_,
    rid: str,
    prompt: list[int],
    params: SamplingParams = SAMPLING,
    src_tp: int = 1,
) -> Reserved:
    """ReserveKV (for a prefill node at TP `src_tp`) on D, then Prefill on P; D's I/O runs
    meanwhile on every rank, so each handshake with each of its receivers gets its answer."""
    decode_.handle(ReserveKV(rid, tuple(prompt), params, src_tp=src_tp))
    reserved = router.recv(Reserved, rid)
    assert len(reserved.kv_endpoints) == decode_.kv.size and reserved.src_tp == src_tp
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [decode_.poll_io() for _ in iter(stop.is_set, True)])
    pump.start()
    try:
        prefill.handle(
            Prefill(
                rid,
                tuple(prompt),
                params,
                reserved.xfer_id,
                reserved.block_ids,
                reserved.kv_endpoints,
                dest_cached_tokens=reserved.cached_tokens,
            )
        )
    finally:
        stop.set()
        pump.join()
    return reserved


def finish_on_decode(router, decode_, rid: str) -> list[int]:
    """The first token (from the prefill node), then step the decode node until the request
    finishes there (a Tokens message with a finish reason)."""
    first = router.recv(Tokens, rid)
    got, finished = list(first.token_ids), bool(first.finish_reason)
    deadline = time.monotonic() + 30
    while not finished:
        assert time.monotonic() < deadline
        decode_.poll_io()
        if decode_.engine.has_unfinished:
            decode_.step()
        for m in router.drain():
            if isinstance(m, Tokens) and m.request_id == rid:
                got += m.token_ids
                finished = bool(m.finish_reason)
    return got


def test_a_prefill_node_stays_eager_unless_asked(nodes) -> None:
    """It runs prompts only, so it never builds the compiled decode graphs (on CUDA they
    would compile at start for nothing); the decode node keeps the device's default."""
    _, prefill, decode_ = nodes
    assert prefill.engine.model_config.enforce_eager is True
    assert decode_.engine.model_config.enforce_eager is None
    assert prefill.engine.runner.compiled is None


def test_pages_of_a_layer_leave_before_the_next_layer_computes(nodes, tiny_model_dir):
    router, prefill, decode_ = nodes
    prompt = list(range(3, 90))  # 87 tokens: 3 chunks of at most 40
    start(router, prefill, decode_, "r1", prompt)
    events: list[tuple[str, int]] = []
    for i, layer in enumerate(prefill.engine.runner.model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: events.append(("compute", i)))
    sender = next(iter(prefill.kv.port.senders.values()))
    send_layer = sender.send_layer
    sender.send_layer = lambda xfer, layer, *a: (
        events.append(("send", layer)),
        send_layer(xfer, layer, *a),
    )[1]
    steps = 0
    while "r1" in prefill.dests:
        prefill.step()
        steps += 1
    assert steps == 3
    n = len(prefill.engine.runner.model.model.layers)
    per_step = [e for layer in range(n) for e in (("compute", layer), ("send", layer))]
    assert events == per_step * steps  # interleaved: send i happens before compute i + 1

    # The decode node admits it and finishes it with the colocated engine's tokens.
    got = finish_on_decode(router, decode_, "r1")
    want = LLM(str(tiny_model_dir("llama")), block_size=BLOCK, dtype="float32").generate(
        [prompt], SAMPLING
    )
    assert got == want[0].token_ids
    prefill.engine.check_integrity()
    decode_.engine.check_integrity()


def test_the_first_token_leaves_before_the_kv_done_message(nodes):
    """The role yields its messages and the loop sends each before the step goes on: the
    router has the first token before the decode node can admit the request."""
    router, prefill, decode_ = nodes
    start(router, prefill, decode_, "r", list(range(3, 30)))
    events: list[str] = []
    tell = prefill.membership.tell
    prefill.membership.tell = lambda rid, msg: (events.append(type(msg).__name__), tell(rid, msg))
    sender = next(iter(prefill.kv.port.senders.values()))
    send_done = sender.send_done
    sender.send_done = lambda *a: (events.append("KVDone"), send_done(*a))[1]
    while "r" in prefill.dests:
        prefill.step()
    assert events == ["Tokens", "KVDone"]
    assert "r" not in prefill.engine.scheduler.requests  # handed off: nothing held here


def test_a_broken_kv_connection_fails_only_its_requests(nodes):
    router, prefill, decode_ = nodes
    start(router, prefill, decode_, "bad", list(range(3, 60)))
    sender = next(iter(prefill.kv.port.senders.values()))

    def broken(*_):
        raise TransferError("peer went away")

    sender.send_layer = broken
    prefill.step()
    error = router.recv(Error, "bad")
    assert error.kind is Failure.KV_FAILED and "peer went away" in error.message
    assert "bad" not in prefill.dests and not prefill.kv.port.senders  # reconnects next time
    assert not prefill.engine.has_unfinished
    assert all(not isinstance(m, Tokens) for m in router.drain())  # no token before the error
    prefill.engine.check_integrity()
    assert prefill.engine.kv.num_free_blocks == prefill.engine.runner.num_blocks - 1
    # The next request reconnects and goes through.
    start(router, prefill, decode_, "good", list(range(5, 30)))
    while "good" in prefill.dests:
        prefill.step()
    assert router.recv(Tokens, "good").token_ids


def test_heartbeats_report_prefix_cache_changes_and_a_snapshot_on_request(nodes):
    router, prefill, decode_ = nodes
    prefill.heartbeat()
    first = router.recv(Heartbeat, "")
    assert first.prefix_seq == 1 and first.prefix_reset and first.prefix_stored == ()
    prompt = list(range(3, 60))  # 3 full blocks of 16 get cached
    start(router, prefill, decode_, "r", prompt)
    while "r" in prefill.dests:
        prefill.step()
    prefill.heartbeat(now=True)
    delta = router.recv(Heartbeat, "")
    assert delta.prefix_seq == 2 and not delta.prefix_reset
    assert delta.prefix_stored == tuple(hash_token_blocks(prompt, BLOCK))
    prefill.handle(SyncPrefixes())
    prefill.heartbeat()
    snapshot = router.recv(Heartbeat, "")
    assert snapshot.prefix_seq == 3 and snapshot.prefix_reset
    assert set(snapshot.prefix_stored) == set(delta.prefix_stored)
    decode_.heartbeat()  # decode nodes report theirs too (a conversation's next turn)
    report = router.recv(Heartbeat, "")
    assert report.node_id == decode_.node_id and report.prefix_seq == 1 and report.prefix_reset


def run_to_end(router, prefill, decode_, rid: str) -> list[int]:
    """Step both nodes until the request finished on the decode node; its tokens."""
    while rid in prefill.dests:
        prefill.step()
    return finish_on_decode(router, decode_, rid)


def test_a_second_turn_ships_only_the_blocks_the_decode_node_lacks(nodes, tiny_model_dir):
    """The decode node holds turn 1's prompt and answer: turn 2's reservation shares them and
    the prefill node sends pages of the later blocks only; the answer is the engine's."""
    router, prefill, decode_ = nodes
    llm = LLM(str(tiny_model_dir("llama")), block_size=BLOCK, dtype="float32")
    turn1 = list(range(3, 60))
    first = start(router, prefill, decode_, "t1", turn1)
    assert first.cached_tokens == 0
    answer = run_to_end(router, prefill, decode_, "t1")
    turn2 = turn1 + answer + list(range(200, 230))  # 92 tokens; 61 of turn 1 hold KV on D
    sent: list[int] = []
    reserved = start(router, prefill, decode_, "t2", turn2)
    assert reserved.cached_tokens == 48  # 3 full blocks; the 4th has tokens of turn 2
    sender = next(iter(prefill.kv.port.senders.values()))
    send_layer = sender.send_layer
    sender.send_layer = lambda xfer, layer, src, dst, cache, heads=None: (
        sent.extend(dst),
        send_layer(xfer, layer, src, dst, cache, heads),
    )[1]
    got = run_to_end(router, prefill, decode_, "t2")
    assert got == llm.generate([turn2], SAMPLING)[0].token_ids
    assert set(sent) == set(reserved.block_ids[3:])  # never a shared block
    decode_.engine.check_integrity()
    prefill.engine.check_integrity()


REGEX = r"(cat|dog)-[0-9]{2,3}"
CHOICES = ("alpha beta", "gamma delta epsilon")
# Each constraint is several tokens long under the tiny model's greedy draw, and the prefill
# node's first token leaves the grammar mid-way: a decode node that lost the grammar, or did
# not advance it past that token, writes text outside it (and unlike the colocated engine).
HANDED_OFF = {
    "regex": (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
}


@pytest.mark.parametrize("kind", list(HANDED_OFF))
def test_the_decode_node_keeps_a_handed_off_requests_grammar(nodes, tiny_model_dir, kind):
    """The prefill node samples the first token under the request's grammar; the decode node
    goes on under the same grammar, advanced past that token: every token it adds is one the
    grammar allows, the text follows the constraint, and all equal the colocated engine's."""
    router, prefill, decode_ = nodes
    constraint, follows = HANDED_OFF[kind]
    params = SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=constraint)
    prompt = list(range(3, 40))
    llm = LLM(str(tiny_model_dir("llama")), block_size=BLOCK, dtype="float32")
    (want,) = llm.generate([prompt], params)
    assert want.finish_reason == "stop" and follows(want.text), want.text
    assert len(want.token_ids) > 3  # the decode node writes most of it

    start(router, prefill, decode_, kind, prompt, params)
    while kind in prefill.dests:
        prefill.step()
    got = finish_on_decode(router, decode_, kind)

    # Token by token: a fresh matcher takes every one (ValueError names the first it refuses).
    grammar = llm.engine.structured.grammar(constraint, got)
    assert grammar.terminated
    text = llm.tokenizer.decode(got, skip_special_tokens=True)
    assert follows(text), text
    assert got == want.token_ids
    assert not decode_.engine.has_unfinished
    prefill.engine.check_integrity()
    decode_.engine.check_integrity()

"""Typed payloads on the wire: sampling parameters (structured outputs and logprob options
included) and logprobs travel as maps of their dataclasses' fields, round trip exactly, and are
refused field by field, naming the field; a node answers a refused request at once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from pdserve.common.node.membership import ControlClient
from pdserve.common.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    Failure,
    Message,
    Prefill,
    ProtocolError,
    RegisterNode,
    RenewTransfer,
    Reserved,
    ReserveKV,
    Tokens,
    decode,
    encode,
)
from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams, TokenLogprobs

CONSTRAINTS = [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex="[ab]+"),
    StructuredOutputsParams(choice=("yes", "no")),
    StructuredOutputsParams(grammar='root ::= "x"'),
]
FULL = SamplingParams(
    max_tokens=9,
    min_tokens=2,
    temperature=0.7,
    top_k=5,
    top_p=0.9,
    min_p=0.05,
    seed=11,
    stop_token_ids=(3, 4),
    ignore_eos=True,
    logprobs=3,
    prompt_logprobs=0,
)
LPS = (
    TokenLogprobs(5, -0.5, ((5, -0.5), (6, -1.25))),
    TokenLogprobs(7, -math.inf, (), 0),
)
PAYLOADS: list[Message] = [
    *(Prefill("r", (1, 2), SamplingParams(structured_outputs=so)) for so in CONSTRAINTS),
    Prefill("r", (1, 2), FULL, "x", (4, 5), ("tcp://127.0.0.1:1",), "i", 16, (9,)),
    ReserveKV("r", (1, 2, 3), FULL, (7,)),
    ReserveKV("r", (1, 2, 3), FULL, src_tp=4),
    RenewTransfer("r", src_tp=2),
    Reserved("r", "x", (4, 5), ("tcp://h:1", "tcp://h:2"), "i", 16, src_tp=2),
    RegisterNode("d", "decode", ("tcp://h:1", "tcp://h:2"), "zmq", "ab", 8, 16, 64, tp_size=2),
    Tokens("r", (5, 7), LPS, "length", 3, (TokenLogprobs(2, -3.0, ((8, -0.1),), 4),)),
    Tokens("r", (5,)),
]


@pytest.mark.parametrize("msg", PAYLOADS, ids=lambda m: m.TYPE)
def test_every_typed_payload_round_trips(msg: Message) -> None:
    back = decode(encode(msg))
    assert back == msg
    for name in ("sampling", "logprobs", "prompt_logprobs"):  # dataclasses, not plain maps
        value = getattr(back, name, None)
        assert value is None or type(value) is type(getattr(msg, name))
    if isinstance(back, Prefill):
        assert back.sampling.structured_outputs == msg.sampling.structured_outputs


def body_of(msg: Message) -> dict[str, Any]:
    return msgpack.unpackb(encode(msg))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change to a message body: `path` is dotted, into nested maps."""

    def change(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            body = body[key]
        body[last] = value

    return change


REGEX = Prefill("r", (1,), SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
BAD_SAMPLING = {
    "wrong type": (
        _set("sampling.temperature", "hot"),
        r"prefill.sampling.temperature: expected float",
    ),
    "bool is not int": (
        _set("sampling.max_tokens", True),
        r"prefill.sampling.max_tokens: expected int",
    ),
    "unknown field": (
        _set("sampling.beam_width", 4),
        r"prefill.sampling: unknown fields \['beam_width'\]",
    ),
    "not a map": (_set("sampling", [1, 2]), r"prefill.sampling: expected SamplingParams"),
    "out of range": (_set("sampling.top_p", 2.0), r"prefill.sampling: top_p must be in \(0, 1\]"),
    "logprob options": (_set("sampling.logprobs", 21), r"prefill.sampling: logprobs must be 0..20"),
    "nested wrong type": (
        _set("sampling.structured_outputs.regex", 5),
        r"prefill.sampling.structured_outputs.regex: expected str",
    ),
    "nested two constraints": (
        _set("sampling.structured_outputs.choice", ["x"]),
        r"prefill.sampling.structured_outputs: structured_outputs must set exactly one",
    ),
    "nested unknown field": (
        _set("sampling.structured_outputs.xml", "<a/>"),
        r"prefill.sampling.structured_outputs: unknown fields \['xml'\]",
    ),
    "nested choice item": (
        _set("sampling.structured_outputs", {"choice": ["ok", 3]}),
        r"prefill.sampling.structured_outputs.choice: expected str",
    ),
}


@pytest.mark.parametrize("name", BAD_SAMPLING)
def test_a_bad_sampling_field_is_refused_naming_it(name: str) -> None:
    change, why = BAD_SAMPLING[name]
    body = body_of(REGEX)
    change(body)
    with pytest.raises(ProtocolError, match=why) as refused:
        decode(msgpack.packb(body))
    assert refused.value.request_id == "r"  # the node can fail that request at once


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda b: b["logprobs"][0].pop("logprob"), r"tokens.logprobs: missing field 'logprob'"),
        (lambda b: b["logprobs"][0].update(top=[[5]]), r"tokens.logprobs.top: expected"),
        (lambda b: b.update(logprobs=[[5, -0.5, []]]), r"tokens.logprobs: expected TokenLogprobs"),
        (lambda b: b["prompt_logprobs"][0].update(rank="1"), r"tokens.prompt_logprobs.rank"),
    ],
)
def test_bad_logprobs_are_refused_naming_the_field(change, why) -> None:
    body = body_of(PAYLOADS[-2])
    change(body)
    with pytest.raises(ProtocolError, match=why):
        decode(msgpack.packb(body))


@pytest.fixture()
def router() -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    yield sock
    sock.close()


def test_a_node_answers_a_refused_request_with_a_bad_request_error(router: zmq.Socket) -> None:
    """A frame that names its request fails that request at once (the client gets a 400-style
    error, not a token timeout); one that names none is only counted."""
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = ControlClient(zmq.Context.instance(), f"127.0.0.1:{port}", "node-a")
    try:
        bad = body_of(REGEX)
        bad["sampling"]["top_p"] = 0.0
        nameless = dict(bad)
        del nameless["request_id"]
        client.send(Tokens("hello", ()))  # the router learns the node's identity
        assert router.poll(5000)
        identity, _ = router.recv_multipart()
        for frame in (nameless, bad):
            router.send_multipart([identity, msgpack.packb(frame)])
        got: list[Message] = []
        for _ in range(50):  # until both frames are in (each recv waits up to 100 ms)
            got += client.recv(100)
            if client.num_malformed == 2:
                break
        assert got == [] and client.num_malformed == 2
        assert router.poll(5000)
        answer = decode(router.recv_multipart()[1])
        assert isinstance(answer, Error)
        assert (answer.request_id, answer.kind) == ("r", Failure.BAD_REQUEST)
        assert "prefill.sampling: top_p must be in (0, 1]" in answer.message
    finally:
        client.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            {
                "type": "reserve_kv",
                "request_id": "r",
                "prompt_token_ids": [1],
                "sampling": {},
                "src_tp": 0,
            },
            "tensor-parallel size must be >= 1, got 0",
        ),
        (
            {"type": "renew_transfer", "request_id": "r", "src_tp": -1},
            "tensor-parallel size must be >= 1, got -1",
        ),
        (
            {
                "type": "register_node",
                "node_id": "d",
                "role": "decode",
                "kv_endpoints": ["tcp://h:1"],
                "kv_connector": "zmq",
                "layout_digest": "",
                "num_blocks": 8,
                "block_size": 16,
                "max_model_len": 64,
                "tp_size": 2,
            },
            "1 KV endpoints for 2 ranks",
        ),
    ],
)
def test_tensor_parallel_fields_are_checked(body, why) -> None:
    frame = msgpack.packb({**body, "version": PROTOCOL_VERSION})
    with pytest.raises(ProtocolError, match=why):
        decode(frame)

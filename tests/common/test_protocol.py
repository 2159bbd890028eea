"""Wire protocol: round trips, strict typed decoding, bounded sizes, no pickle."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.common.wire import messages as protocol
from pdserve.common.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    IntegrityReport,
    ProtocolError,
    decode,
    encode,
)


def test_round_trip_keeps_types():
    msg = IntegrityReport(nonce=3, ok=True, num_blocks=10, live_requests=("a", "b"))
    assert decode(encode(msg)) == msg
    assert decode(encode(Abort("r1"))) == Abort("r1", "")


V = PROTOCOL_VERSION


def raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


BAD = {
    "not a map": (raw([1, 2, 3]), "not a map"),
    "garbage": (b"\xc1\xff\x00garbage", "undecodable"),
    "truncated": (encode(Error("r", "boom"))[:-3], "undecodable"),
    "unknown type": (raw({"type": "nope", "version": V}), "unknown message type"),
    "no type": (raw({"version": V, "request_id": "x"}), "unknown message type"),
    "old version": (raw({"type": "abort", "version": 0, "request_id": "x"}), "version"),
    "missing field": (raw({"type": "abort", "version": V}), "missing field"),
    "unknown field": (
        raw({"type": "abort", "version": V, "request_id": "x", "evil": 1}),
        "unknown fields",
    ),
    "wrong type": (raw({"type": "abort", "version": V, "request_id": 5}), "expected str"),
    "bool is not int": (
        raw({"type": "check_integrity", "version": V, "nonce": True}),
        "expected int",
    ),
    "unknown failure kind": (
        raw({"type": "error", "version": V, "request_id": "x", "message": "m", "kind": "oops"}),
        "expected Failure",
    ),
    "non-str map key": (raw({1: 2}), "undecodable"),
    "list item type": (
        raw(
            {"type": "integrity_report", "version": V, "nonce": 1, "ok": True, "live_requests": [1]}
        ),
        "expected str",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_malformed_frames_are_refused(name):
    frame, why = BAD[name]
    with pytest.raises(ProtocolError, match=why):
        decode(frame)


def test_oversized_frame_is_refused_before_parsing(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 64)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(encode(Abort("x" * 100)))


def test_pickle_payload_is_just_garbage():
    import pickle

    with pytest.raises(ProtocolError):
        decode(pickle.dumps(Abort("x")))

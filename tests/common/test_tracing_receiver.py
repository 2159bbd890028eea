"""common/tracing_receiver.py: the OTLP/HTTP endpoint hands each export's body to its hook
(gunzipped when compressed); run as a process of its own it counts what it dropped."""

from __future__ import annotations

import gzip

import httpx

from pdserve.common.tracing_receiver import OtlpReceiver, ReceiverProcess


def test_each_export_body_goes_to_the_hook_gunzipped() -> None:
    got: list[bytes] = []
    with OtlpReceiver(got.append) as receiver:
        assert receiver.url.endswith("/v1/traces")
        plain = httpx.post(receiver.url, content=b"spans", timeout=10)
        zipped = httpx.post(
            receiver.url,
            content=gzip.compress(b"more spans"),
            headers={"Content-Encoding": "gzip"},
            timeout=10,
        )
    assert plain.status_code == zipped.status_code == 200
    assert got == [b"spans", b"more spans"]


def test_the_receiver_process_counts_what_it_dropped() -> None:
    receiver = ReceiverProcess()
    for body in (b"x" * 10, b"y" * 32):
        assert httpx.post(receiver.url, content=body, timeout=10).status_code == 200
    assert receiver.close() == {"batches": 2, "bytes": 42}

"""Tracing across real processes on loopback: a router and a 1P1D pair export their spans to an
OTLP/HTTP receiver the test runs (the exporter's own protobuf classes decode them).

One request's spans come from all three processes under one trace id; the prefill node's and
the decode node's spans hang under the router's request span (the decode side is never a child
of the prefill); every stage has its span and attributes; an incoming traceparent is
continued; no attribute carries the prompt or the answer. The same requests' TTFT stages come
back in the response (`return_metrics`) and are counted on /metrics.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.offline import kv_bytes_per_token
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.tracing_receiver import OtlpReceiver
from pdserve.local_cluster import LocalCluster
from pdserve.router.cluster.timing import HANDOFF_STAGES, TTFT_STAGES
from pdserve.tiny_model import make_tiny_model
from tests.devices import engine_flags

# Chunks of 32 tokens: a prompt of ~360 tokens is prefilled in several steps (chunk spans).
ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "32", "--max-model-len", "1100"]
ENGINE += engine_flags()
PROMPT = "zebra quartz " * 40  # ~360 tokens of a text no attribute may carry
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
EXPECTED = {
    "pdserve-router": {
        "llm_request",
        "router.ingress",
        "router.queue",
        "router.route",
        "router.reserve",
    },
    "pdserve-prefill": {"prefill", "prefill.queue", "prefill.chunk", "prefill.kv_send"},
    "pdserve-decode": {
        "decode.reserve",
        "decode.kv_transfer",
        "decode.admission",
        "decode.first_step",
    },
}


@dataclass(frozen=True, slots=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]


def _value(v) -> object:  # an OTLP AnyValue
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace endpoint on loopback that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.endpoint = OtlpReceiver(self.take)
        self.url = self.endpoint.url

    def take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = Span(
                        str(resource.get("service.name")),
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes},
                    )
                    with self.lock:
                        self.spans.append(span)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, timeout: float = 60.0) -> list[Span]:
        """The trace's spans once every expected one came (the exporters batch them)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            have = {(s.service, s.name) for s in spans}
            if all((svc, n) in have for svc, names in EXPECTED.items() for n in names):
                return spans
            time.sleep(0.2)
        return self.trace(trace_id)

    def close(self) -> None:
        self.endpoint.close()


@contextlib.contextmanager
def traced_cluster(
    folder: Path,
    receiver: Receiver,
    decode: int = 1,
    engine: Sequence[str] = (),
    router: Sequence[str] = (),
    node_args: dict[str, list[str]] | None = None,
    **env: str | None,
) -> Iterator[LocalCluster]:
    """1P and `decode` D nodes of the tiny model and a router, every process exporting its
    spans to `receiver` within 0.1 s (not 5), prefill always remote; `engine` flags for every
    node, `router` for the router, `node_args` by node; `env` set (None: unset)."""
    model = make_tiny_model("llama", folder / "m", max_position=2048)
    tracing = ["--otlp-traces-endpoint", receiver.url]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        for name, value in env.items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        c = LocalCluster(
            str(model),
            1,
            decode,
            engine_args=[*ENGINE, *engine, *tracing],
            router_args=[*tracing, "--prefill-placement", "remote", *router],
            node_args=node_args or {},
        )
        with c:
            yield c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, receiver) -> Iterator[LocalCluster]:
    with traced_cluster(tmp_path_factory.mktemp("tracing"), receiver) as c:
        yield c


@pytest.fixture(scope="module")
def untraced(tmp_path_factory) -> Iterator[LocalCluster]:
    """A 1P1D pair without tracing: the client that times its requests shares no process with
    an OTLP receiver decoding spans."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("untraced") / "m", max_position=2048)
    router = ["--prefill-placement", "remote"]
    # Long steps (1,024 tokens): prompts that come during one wait for its end.
    engine = [*ENGINE[:2], "--max-num-batched-tokens", "1024", *ENGINE[4:]]
    with LocalCluster(str(model), 1, 1, engine_args=engine, router_args=router) as c:
        yield c


def complete(url: str, headers: dict[str, str] | None = None, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_one_trace_across_router_prefill_and_decode(cluster, receiver) -> None:
    traceparent = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"
    answer = complete(cluster.url, {"traceparent": traceparent})
    spans = receiver.wait_for(PARENT_TRACE)
    names = by_name(spans)
    for service, expected in EXPECTED.items():
        got = {s.name for s in spans if s.service == service}
        assert expected <= got, f"{service} lacks {expected - got}"
    (request,) = names["llm_request"]
    assert request.parent_id == PARENT_SPAN, "the client's traceparent is continued"
    # Both nodes' top spans are children of the router's request span: the decode side is a
    # sibling of the prefill, not its child.
    for name in ("prefill", *EXPECTED["pdserve-decode"]):
        for span in names[name]:
            assert span.parent_id == request.span_id, f"{name} is not under the request span"
    (prefill,) = names["prefill"]
    for name in ("prefill.queue", "prefill.chunk"):
        assert {s.parent_id for s in names[name]} == {prefill.span_id}
    assert len(names["prefill.chunk"]) >= 2, "a prompt of several chunks"
    assert sum(s.attributes["pdserve.chunk.tokens"] for s in names["prefill.chunk"]) > 0
    (route,) = names["router.route"]
    assert route.attributes["pdserve.chosen"] == "decode0"
    assert route.attributes["pdserve.prefill"] == "remote"
    assert route.attributes["pdserve.candidates"] == ["decode0"]
    assert route.attributes["pdserve.prefill_candidates"] == ["prefill0"]
    assert re.fullmatch(r"decode0:\d+", route.attributes["pdserve.cached_blocks"][0])
    assert route.attributes["pdserve.why"]
    (kv,) = names["decode.kv_transfer"]
    assert kv.attributes["pdserve.kv.checksum_ok"] is True
    assert kv.attributes["pdserve.kv.connector"] == "zmq"
    assert kv.attributes["pdserve.kv.pages"] >= 1
    # Bytes of every layer's K and V in the pages moved (bfloat16 or float32: `--dtype auto`).
    per_page = {16 * kv_bytes_per_token(ModelArchConfig.from_dir(cluster.model), i) for i in (2, 4)}
    assert kv.attributes["pdserve.kv.bytes"] / kv.attributes["pdserve.kv.pages"] in per_page
    (sent,) = names["prefill.kv_send"]
    assert sent.attributes["pdserve.kv.pages"] == kv.attributes["pdserve.kv.pages"]
    assert names["router.reserve"][0].attributes["pdserve.outcome"] == "reserved"
    assert request.attributes["gen_ai.usage.completion_tokens"] == 6
    ttft = request.attributes["gen_ai.latency.time_to_first_token"]
    assert ttft > 0
    # The TTFT taken apart in the trace too: each stage on the request span, adding up to it.
    stages = {s: request.attributes[f"pdserve.ttft.{s}"] for s in TTFT_STAGES}
    assert sum(stages.values()) == pytest.approx(ttft, abs=1e-6), (stages, ttft)
    assert all(request.attributes[f"pdserve.handoff.{s}"] > 0 for s in HANDOFF_STAGES)
    text = answer["choices"][0]["text"]
    for span in spans:  # no prompt or answer text in any attribute
        for key, value in span.attributes.items():
            assert "zebra" not in str(value) and "quartz" not in str(value), (span.name, key)
            assert len(text) < 4 or text not in str(value), (span.name, key)


def test_a_request_without_traceparent_starts_its_trace_at_the_router(cluster, receiver) -> None:
    before = {s.span_id for s in receiver.spans}
    complete(cluster.url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        roots = [
            s
            for s in receiver.spans
            if s.name == "llm_request" and s.span_id not in before and s.trace_id != PARENT_TRACE
        ]
        if roots:
            break
        time.sleep(0.2)
    (root,) = roots
    assert root.parent_id == ""
    spans = receiver.wait_for(root.trace_id)
    assert {s.service for s in spans} == set(EXPECTED)


def test_the_ttft_stages_come_back_and_are_counted(cluster) -> None:
    before = stage_counts(cluster.url)
    for stream in (False, True):
        metrics = _metrics_of(cluster.url, stream)
        stages, ttft = metrics["ttft_stages"], metrics["time_to_first_token"]
        assert set(stages) == set(TTFT_STAGES)
        assert all(v >= 0 for v in stages.values()), stages
        assert sum(stages.values()) == pytest.approx(ttft, abs=1e-6), (stages, ttft)
        handoff = metrics["handoff_stages"]
        assert set(handoff) == set(HANDOFF_STAGES)
        assert all(v > 0 for v in handoff.values()), handoff
    assert counted(cluster.url, before, 2) == {s: 2 for s in STAGES}, "each request once"


STAGES = [*TTFT_STAGES, *HANDOFF_STAGES]


def stage_counts(url: str) -> dict[str, float]:
    """Each TTFT and hand-off stage's histogram count on the router's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("pdserve:ttft_stage_seconds", "pdserve:handoff_stage_seconds"):
            for s in family.samples:
                if s.name.endswith("_count"):
                    counts[s.labels["stage"]] = s.value
    return counts


def counted(url: str, before: dict[str, float], requests: int) -> dict[str, float]:
    """Each stage's observations since `before`, once every stage has counted `requests` of
    them or 10 s passed (the router observes a request's stages after its last write)."""
    deadline = time.monotonic() + 10
    while True:
        grown = {s: n - before.get(s, 0.0) for s, n in stage_counts(url).items()}
        if all(grown.get(s, 0) >= requests for s in STAGES) or time.monotonic() > deadline:
            return grown
        time.sleep(0.1)


def test_the_stages_add_up_to_the_ttft_each_client_measured_under_load(untraced) -> None:
    """8 requests at once, each from its own connection: every request's stages add up to the
    TTFT its client measured, from just before it wrote the request to the kernel's receive
    time of the chunk with the first token (SO_TIMESTAMPNS: the client's own wake-up is not
    counted), within issue 39's bound: 5% of the TTFT or 5 ms. A prompt that comes while the
    prefill node runs a step waits unread in its socket (1.4 s in a run on the loaded box):
    `node_inbox` holds it. The router's stages run from its first ASGI stamp (router_ingress)
    to its send of the first token's chunk (router_egress); what is left is the request's way
    through the kernel and the router process's wait for a CPU before it reads it."""
    complete(untraced.url)  # the nodes' first forwards (their warm-up) are no part of the load
    before = counted(untraced.url, {}, 1)
    port = int(untraced.url.rsplit(":", 1)[1])
    clients = [StampedClient(port) for _ in range(8)]
    try:
        for client in clients:  # connections accepted and kept: no TCP handshake is timed
            assert client.get("/v1/models").startswith(b"HTTP/1.1 200")
        barrier = threading.Barrier(len(clients), timeout=60)
        with ThreadPoolExecutor(len(clients)) as pool:
            timed = list(pool.map(lambda i: _timed(clients[i], barrier, i), range(len(clients))))
    finally:
        for client in clients:
            client.close()
    for ttft, metrics in timed:
        stages = metrics["ttft_stages"]
        assert set(stages) == set(TTFT_STAGES), stages
        assert all(v >= 0 for v in stages.values()), stages
        assert stages["router_egress"] > 0, "a streamed first token is written after its reading"
        gap = abs(ttft - sum(stages.values()))
        assert gap <= max(0.05 * ttft, 0.005), (gap, ttft, stages)
    # The per-stage histograms count every request of the load, each once.
    assert counted(untraced.url, before, len(clients)) == {s: len(clients) for s in STAGES}


SO_TIMESTAMPNS = 35  # Linux's <asm-generic/socket.h>; Python's socket module does not name it


class StampedClient:
    """An HTTP/1.1 client on one kept connection whose reads give the kernel's receive time
    (epoch s) of the last byte they read: it reads a chunk of a chunked response exactly, never
    into the next, so the time is that of the chunk's own bytes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=300)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def read(self, n: int) -> tuple[bytes, float]:
        data, stamp = b"", 0.0
        while len(data) < n:
            got, ancillary, _, _ = self.sock.recvmsg(n - len(data), socket.CMSG_SPACE(16))
            assert got, "the router closed the connection"
            data += got
            for level, kind, raw in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS):
                    seconds, nanoseconds = struct.unpack("qq", raw)
                    stamp = seconds + nanoseconds * 1e-9
        return data, stamp  # 0: none (the kernel turns timestamps on a moment after asked)

    def line(self) -> bytes:
        data = b""
        while not data.endswith(b"\r\n"):
            data += self.read(1)[0]
        return data[:-2]

    def send(self, method: str, path: str, body: bytes = b"") -> float:
        """Writes a request; the epoch time just before."""
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        start = time.time()
        self.sock.sendall(head.encode() + body)
        return start

    def head(self) -> tuple[bytes, dict[bytes, bytes]]:
        """The response's status line and headers (names lower-cased)."""
        status, headers = self.line(), {}
        while line := self.line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def get(self, path: str) -> bytes:
        self.send("GET", path)
        status, headers = self.head()
        self.read(int(headers[b"content-length"]))
        return status

    def chunks(self) -> Iterator[tuple[bytes, float]]:
        """A chunked body's chunks, each with its last byte's receive time."""
        while size := int(self.line(), 16):
            data, stamp = self.read(size + 2)
            yield data[:-2], stamp
        assert self.line() == b"", "no trailers"

    def close(self) -> None:
        self.sock.close()


def _timed(client: StampedClient, barrier: threading.Barrier, i: int) -> tuple[float, dict]:
    """One streamed request's TTFT as its client measured it, and its metrics."""
    body = {"prompt": f"{i} {PROMPT * 3}", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_metrics": True, "return_token_ids": True}
    barrier.wait()
    start = client.send("POST", "/v1/completions", json.dumps(body).encode())
    status, headers = client.head()
    if b"content-length" in headers:  # an error's body, not a stream
        pytest.fail(f"{status!r}: {client.read(int(headers[b'content-length']))[0]!r}")
    assert status.startswith(b"HTTP/1.1 200") and headers[b"transfer-encoding"] == b"chunked"
    ttft, metrics, events = 0.0, None, b""
    for data, stamp in client.chunks():
        events += data
        *lines, events = events.split(b"\n\n")
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not ttft and any(c.get("token_ids") for c in chunk["choices"]):
                assert stamp, "the first token's chunk came without its receive time"
                ttft = stamp - start
            metrics = chunk.get("metrics", [metrics])[0]
    assert ttft and metrics is not None
    return ttft, metrics


def _metrics_of(url: str, stream: bool) -> dict:
    """One request's metrics, from the body or from the stream's chunk that ends it."""
    if not stream:
        (metrics,) = complete(url, return_metrics=True)["metrics"]
        return metrics
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_metrics": True}
    found = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "metrics" in chunk:
                    assert chunk["choices"][0]["finish_reason"] == "length"
                    found += chunk["metrics"]
    (metrics,) = found
    return metrics

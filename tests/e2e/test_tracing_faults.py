"""Tracing through a failover, real processes on loopback: a router, one prefill node and two
decode nodes export their spans to the OTLP receiver of tests/e2e/test_tracing.py. The decode
node a streamed request runs on is killed (SIGKILL) while it decodes; the request resumes on
the other one, and its trace shows the failover span with its cause under the request span.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.local_cluster import LocalCluster
from tests.e2e.test_tracing import Receiver, Span, by_name, traced_cluster

TRACE = "5c0ffee5c0ffee5c0ffee5c0ffee5c0f"
MAX_TOKENS = 900  # long enough that the kill lands while the decode node still generates


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, receiver) -> Iterator[LocalCluster]:
    with traced_cluster(tmp_path_factory.mktemp("failover"), receiver, decode=2) as c:
        yield c


def decoding_on(cluster: LocalCluster) -> str | None:
    """The decode node the router waits on for a request (its integrity report)."""
    reports = cluster.integrity()
    held = [n for n in ("decode0", "decode1") if (reports.get(n) or {}).get("in_flight", 0)]
    return held[0] if len(held) == 1 else None


def stream_and_kill(cluster: LocalCluster) -> tuple[int, str]:
    """Stream one request; once a few tokens came, kill the decode node that holds it. The
    tokens the client got, and the victim."""
    body = {"prompt": "tally ho " * 20, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
    headers = {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}
    tokens, victim, finish = 0, "", None
    with httpx.stream(
        "POST", cluster.url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "choices" in chunk, chunk  # an error chunk
            choice = chunk["choices"][0]
            tokens += len(choice.get("token_ids") or ())
            finish = choice.get("finish_reason") or finish
            if not victim and tokens >= 3:
                victim = decoding_on(cluster) or ""
                assert victim, "no single decode node held the request"
                cluster.procs[victim].kill()  # SIGKILL: no goodbye
    assert finish == "length", finish
    return tokens, victim


def wait_for_span(receiver: Receiver, name: str, timeout: float = 60.0) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.trace(TRACE)
        if any(s.name == name for s in spans):
            return spans
        time.sleep(0.2)
    return receiver.trace(TRACE)


def test_a_killed_decode_node_shows_as_a_failover_span_with_its_cause(cluster, receiver) -> None:
    tokens, victim = stream_and_kill(cluster)
    assert tokens == MAX_TOKENS, "the answer resumed on the other decode node, whole"
    names = by_name(wait_for_span(receiver, "llm_request"))
    (request,) = names["llm_request"]
    assert request.attributes["pdserve.outcome"] == "finished"
    (failover,) = names["router.failover"]
    assert failover.parent_id == request.span_id
    assert failover.attributes["pdserve.failover.cause"] == "node_gone"
    assert failover.attributes["pdserve.failover.kind"] == "resume"
    assert failover.attributes["pdserve.failover.lost"] == [victim]
    assert victim in str(failover.attributes["pdserve.failover.why"])
    assert failover.attributes["pdserve.outcome"] == "rerouted"
    # Routed twice, each time to another decode node, both under the one request span.
    chosen = [s.attributes["pdserve.chosen"] for s in names["router.route"]]
    survivor = ({"decode0", "decode1"} - {victim}).pop()
    assert chosen == [victim, survivor], chosen
    assert {s.parent_id for s in names["router.route"]} == {request.span_id}

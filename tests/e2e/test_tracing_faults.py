"""Tracing through faults, real processes on loopback exporting their spans to the OTLP
receiver of tests/e2e/test_tracing.py.

A router, one prefill node and two decode nodes: the decode node a streamed request runs on is
killed (SIGKILL) while it decodes; the request resumes on the other one, and its trace shows
the failover span with its cause under the request span.

A router and a 1P1D pair whose decode node leases for 3 s: with the prefill node stopped
(SIGSTOP) the KV a reservation waits for never comes, and with the router stopped too nothing
renews the lease; the decode node frees the request, counts it on its /metrics and exports a
`node.lease_expired` span under the router's request span.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.local_cluster import LocalCluster, free_port
from tests.e2e.test_metrics_vllm_level import Deployment, wait_for
from tests.e2e.test_tracing import Receiver, Span, by_name, complete, traced_cluster

TRACE = "5c0ffee5c0ffee5c0ffee5c0ffee5c0f"
LEASE_TRACE = "1ea5e1ea5e1ea5e1ea5e1ea5e1ea5e00"
LEASE_S = 3.0  # the decode node's lease (the registration waits up to this long too)
MAX_TOKENS = 900  # long enough that the kill lands while the decode node still generates


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


def wait_for_span(
    receiver: Receiver, name: str, trace: str = TRACE, timeout: float = 60.0
) -> list[Span]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.trace(trace)
        if any(s.name == name for s in spans):
            return spans
        time.sleep(0.2)
    return receiver.trace(trace)


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


@pytest.fixture(scope="module")
def leased(tmp_path_factory, receiver) -> Iterator[Deployment]:
    health = {"decode0": free_port()}
    nodes = {"decode0": ["--lease-timeout", str(LEASE_S), "--health-port", str(health["decode0"])]}
    folder = tmp_path_factory.mktemp("lease")
    router = ["--lease-interval", "0.5"]
    with traced_cluster(folder, receiver, router=router, node_args=nodes) as c:
        yield Deployment(c, health)


def test_a_lease_left_to_expire_is_counted_and_traced(leased: Deployment, receiver) -> None:
    procs = leased.cluster.procs
    before = leased.scrape("decode0")
    expired = "pdserve:lease_expirations_total"
    headers = {"traceparent": f"00-{LEASE_TRACE}-00f067aa0ba902b7-01"}
    os.kill(procs["prefill0"].pid, signal.SIGSTOP)  # the reserved KV never comes
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, leased.cluster.url + "/v1/completions",
                                 json={"prompt": "lease " * 40, "max_tokens": 4},
                                 headers=headers, timeout=120)  # fmt: skip
            free = "pdserve_node_free_kv_blocks"
            wait_for(lambda: leased.scrape("decode0")[free] < before[free], "reservation")
            os.kill(procs["router"].pid, signal.SIGSTOP)  # nothing renews the lease
            try:
                wait_for(lambda: leased.scrape("decode0")[expired] > 0, "expiry", 10 * LEASE_S)
            finally:
                os.kill(procs["router"].pid, signal.SIGCONT)
            os.kill(procs["prefill0"].pid, signal.SIGCONT)
            answer.result(timeout=150)  # answered, whatever became of it
    finally:
        os.kill(procs["prefill0"].pid, signal.SIGCONT)
    assert before[expired] == 0 and leased.scrape("decode0")[expired] == 1
    names = by_name(wait_for_span(receiver, "llm_request", LEASE_TRACE))
    (request,) = names["llm_request"]
    (lapsed,) = names["node.lease_expired"]
    assert lapsed.service == "pdserve-decode" and lapsed.parent_id == request.span_id
    assert lapsed.attributes["pdserve.lease_timeout"] == LEASE_S
    assert lapsed.attributes["pdserve.node_id"] == "decode0"
    # The deployment serves on afterwards: the node freed what the request held.
    assert complete(leased.cluster.url)["choices"][0]["finish_reason"] == "length"

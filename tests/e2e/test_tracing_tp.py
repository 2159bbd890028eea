"""Tracing a tensor-parallel deployment, real processes on loopback: a router, a prefill node
and a decode node, each at TP 2, export their spans to the OTLP receiver of
tests/e2e/test_tracing.py. Every rank of each group has its spans under its node's span: the
worker rank's `tp.forward` of each step that ran the traced request, under the prefill node's
`prefill` span and under the decode node's `decode.first_step` span. Then a worker rank of the
decode node is killed while it decodes: the node fences the request it held (an Error of kind
tp_broken), and the router counts it on /metrics.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from pdserve.local_cluster import LocalCluster
from pdserve.testbed import zygote
from tests.e2e.test_tracing import Receiver, Span, by_name, complete, traced_cluster

TRACE = "7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a"
TP2 = ["--tensor-parallel-size", "2", "--threads-per-rank", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, receiver) -> Iterator[LocalCluster]:
    # Worker ranks as their node's own children (not forked by the suite's launcher): the
    # last test finds the decode node's worker among them to kill it.
    unforked = {zygote.RANKS_ENV: None}
    with traced_cluster(tmp_path_factory.mktemp("tp"), receiver, engine=TP2, **unforked) as c:
        yield c


def wait_for_ranks(receiver: Receiver, expected: int, timeout: float = 60.0) -> list[Span]:
    """The trace once `expected` worker-rank spans and the request span came (every process
    exports on its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = by_name(receiver.trace(TRACE))
        if len(names.get("tp.forward", [])) >= expected and "llm_request" in names:
            break
        time.sleep(0.2)
    time.sleep(0.5)  # a span too many would come with the others: give it the time to come
    return receiver.trace(TRACE)


def test_every_rank_of_a_tp_group_has_its_spans_under_its_nodes_span(cluster, receiver) -> None:
    complete(cluster.url, {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})
    first = by_name(receiver.wait_for(TRACE))
    chunks = len(first["prefill.chunk"])
    assert chunks >= 2, "a prompt of several chunks"
    names = by_name(wait_for_ranks(receiver, chunks + 1))
    (prefill,) = names["prefill"]
    (first_step,) = names["decode.first_step"]
    ranks = names["tp.forward"]
    under_prefill = [s for s in ranks if s.parent_id == prefill.span_id]
    under_decode = [s for s in ranks if s.parent_id == first_step.span_id]
    # One span of the worker rank per step of the prompt (rank 0's are the chunks) ...
    assert len(under_prefill) == chunks, (len(under_prefill), chunks)
    assert {s.service for s in under_prefill} == {"pdserve-prefill"}
    # ... and one of the decode node's first step; none of later steps, none elsewhere.
    assert len(under_decode) == 1
    assert under_decode[0].service == "pdserve-decode"
    assert len(ranks) == chunks + 1
    assert {s.attributes["pdserve.tp_rank"] for s in ranks} == {1}
    assert all(s.attributes["pdserve.step.tokens"] > 0 for s in ranks)
    request = names["llm_request"][0]
    assert prefill.parent_id == first_step.parent_id == request.span_id


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found is not None, f"{name} is not on /metrics"
    return float(found.group(1))


def kill_a_rank(node: psutil.Process) -> None:
    (worker,) = [p for p in node.children() if "tensor_parallel_worker" in " ".join(p.cmdline())]
    worker.kill()


def test_a_killed_rank_fences_its_nodes_request_and_the_router_counts_it(cluster) -> None:
    """Last in this module: the decode node stops."""
    fenced, by_cause = (
        "pdserve:tp_fenced_requests_total",
        'pdserve:failovers_total{cause="tp_broken"}',
    )
    assert counter(cluster.url, fenced) == 0
    decode = psutil.Process(cluster.procs["decode0"].pid)
    body = {"prompt": "one two " * 10, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_token_ids": True}
    tokens, killed = 0, False
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            tokens += sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
            if tokens >= 3 and not killed:
                kill_a_rank(decode)
                killed = True
    assert killed, "the answer ended before a rank was killed"
    assert tokens < 900, "the answer went on without its decode node"
    assert counter(cluster.url, fenced) == 1
    assert counter(cluster.url, by_cause) == 1
    decode.wait(30)  # the node stops as a whole

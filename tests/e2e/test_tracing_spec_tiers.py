"""Tracing of speculation and KV tiers across real processes (issue 39): a router and a 1P1D pair
export to an OTLP receiver the test runs; the prefill node has a 16-block pool over a file://
store (loads pinned on), the decode node drafts with ngram.

- A prompt whose tail blocks the pool evicted (to the store) comes back: its prefill node's
  `node.tier_load` span, under its `prefill` span, counts the blocks the file tier served, and
  its tokens are the prefill node's `pdserve:kv_tier_loaded_tokens` delta.
- A request's `decode.speculation` span (under the router's request span, ended when it
  finished) carries its drafts, drafted tokens and accepted tokens: the decode node's counters'
  deltas, exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.local_cluster import LocalCluster, free_port
from tests.e2e.test_tracing import Receiver, Span, by_name, traced_cluster

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
BLOCK = 16
# 16 blocks of 16 tokens (one the null block): 240 tokens at most in the prefill node's pool.
PREFILL = ["--num-blocks", "16", "--max-model-len", "240", "--kv-load-policy", "always"]
LOADED_TOKENS = "pdserve:kv_tier_loaded_tokens"
SPEC_COUNTERS = {
    "pdserve.spec.num_drafts": "pdserve_node_spec_decode_num_drafts",
    "pdserve.spec.num_draft_tokens": "pdserve_node_spec_decode_num_draft_tokens",
    "pdserve.spec.num_accepted_tokens": "pdserve_node_spec_decode_num_accepted_tokens",
}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, receiver) -> Iterator[tuple[LocalCluster, int, int]]:
    """The cluster, the prefill node's and the decode node's health ports."""
    folder = tmp_path_factory.mktemp("tracing_tiers")
    prefill, decode = free_port(), free_port()
    store = ["--kv-store", f"file://{folder / 'store'}", "--health-port", str(prefill)]
    nodes = {
        "prefill0": [*PREFILL, *store],
        "decode0": ["--speculative-config", SPEC, "--health-port", str(decode)],
    }
    with traced_cluster(folder, receiver, node_args=nodes) as c:
        yield c, prefill, decode


def metrics(port: int) -> dict[str, float]:
    """A node's /metrics samples by name (a tier's by `name{tier}`)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = f"{s.name}{{{s.labels['tier']}}}" if "tier" in s.labels else s.name
            out[key] = s.value
    return out


def settled(
    read: Callable[[], dict[str, float]], names: list[str], at_least: dict[str, float] | None = None
) -> dict[str, float]:
    """`read()` once the named values reached `at_least` and held still for 1.5 s (they are
    published with the node's heartbeat, which a loaded machine delays)."""
    at_least = at_least or {}
    last, deadline = read(), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = read()
        reached = all(now.get(n, 0.0) >= v for n, v in at_least.items())
        if reached and all(now.get(n) == last.get(n) for n in names):
            return now
        last = now
    raise AssertionError(f"{names} not at {at_least} or still moving after 30 s")


def traced(url: str, receiver: Receiver, prompt: list[int], *want: str, **extra) -> list[Span]:
    """The spans of one request (its own trace id) once every span named in `want` came (the
    nodes export in batches: a span that ended first may come alone)."""
    trace_id = f"{time.time_ns():032x}"[-32:]
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if set(want) <= {s.name for s in spans}:
            return spans
        time.sleep(0.2)
    raise AssertionError(f"no {want} span in {sorted({s.name for s in receiver.trace(trace_id)})}")


def test_a_prefix_loaded_from_the_file_store_is_a_span_with_the_nodes_counts(
    deployment, receiver
) -> None:
    cluster, prefill, _ = deployment
    first = [3 + i % 200 for i in range(5 * BLOCK + 4)]  # 5 full blocks
    other = [250 + i % 200 for i in range(13 * BLOCK + 4)]  # 13 blocks: the pool evicts first's
    spans = traced(cluster.url, receiver, first, "prefill")
    assert not by_name(spans).get("node.tier_load"), "nothing in the store yet"
    traced(cluster.url, receiver, other, "prefill")
    before = settled(lambda: metrics(prefill), [LOADED_TOKENS + "_total"])
    spans = traced(cluster.url, receiver, first, "node.tier_load", "prefill")
    names = by_name(spans)
    (load,), (node,) = names["node.tier_load"], names["prefill"]
    assert load.parent_id == node.span_id, "under the prefill node's span"
    attrs = load.attributes
    total = LOADED_TOKENS + "_total"
    after = settled(lambda: metrics(prefill), [total], {total: before[total] + 1})
    assert attrs["pdserve.kv_tier.file.blocks"] >= 1, attrs
    blocks = sum(v for k, v in attrs.items() if k.endswith(".blocks"))
    assert attrs["pdserve.kv_tier.tokens"] == blocks * BLOCK
    loaded = after[total] - before[total]
    assert attrs["pdserve.kv_tier.tokens"] == loaded, (attrs, loaded)
    assert attrs["pdserve.kv_tier.recompute_chosen_blocks"] == 0  # --kv-load-policy always
    assert attrs["pdserve.kv_tier.bytes"] > 0
    assert not any("store" in str(v) for v in attrs.values()), "no store path in the span"


def test_a_speculated_request_spans_its_drafts_with_the_decode_nodes_counts(
    deployment, receiver
) -> None:
    cluster, _, decode = deployment
    before = settled(lambda: metrics(decode), list(SPEC_COUNTERS.values()))
    prompt = [5, 6, 7, 8] * 10
    spans = traced(
        cluster.url, receiver, prompt, "decode.speculation", "llm_request", max_tokens=24
    )
    names = by_name(spans)
    (spec,), (request,) = names["decode.speculation"], names["llm_request"]
    drafts = SPEC_COUNTERS["pdserve.spec.num_drafts"]
    moved = {drafts: before[drafts] + 1}  # the heartbeat after the request's first verify step
    after = settled(lambda: metrics(decode), list(SPEC_COUNTERS.values()), moved)
    assert spec.service == "pdserve-decode" and spec.parent_id == request.span_id
    attrs = spec.attributes
    assert attrs["pdserve.spec.method"] == "ngram" and attrs["pdserve.outcome"] == "length"
    assert attrs["pdserve.spec.num_drafts"] >= 1, attrs
    for attr, counter in SPEC_COUNTERS.items():
        assert attrs[attr] == after[counter] - before[counter], (attr, attrs, before, after)

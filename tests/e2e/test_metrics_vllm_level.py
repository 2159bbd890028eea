"""The vLLM-level metrics (docs/api.md, "Metrics") on real processes: a router and a 1P1D pair
on loopback. Each metric is on the /metrics of the process that measures it and moves under a
small load (read before and after); a decode node gone silent moves the failover counter; a
second pair whose prefill node corrupts every KV frame moves the transfer-failure counter; every
PromQL expression of the Grafana dashboard names only metrics a scrape of this deployment shows.
The lease-expiry count is exported (at 0 here) but not moved: a SIGSTOPped router let the
answer finish before its 2 s lease ran out on an idle CI machine. The count is moved in
tests/e2e/test_tracing_faults.py, which holds a decode node's reservation with no KV coming
(the prefill node and then the router SIGSTOPped) until its lease lapses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.local_cluster import LocalCluster, free_port
from pdserve.testbed import kvfaults
from pdserve.tiny_model import make_tiny_model
from tests.devices import engine_flags

ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "64", "--max-model-len", "1100"]
ENGINE += ["--heartbeat-interval", "0.2", "--lease-timeout", "2"] + engine_flags()
# 40 blocks on the decode node (the null block aside): six answers of 112 tokens after prompts
# of 48 (10 blocks each) do not fit together, so it preempts (and recomputes) some.
DECODE = ["--num-blocks", "41", "--max-model-len", "640"]
LONG = 640 - 48  # tokens of an answer still running when the test acts
ROUTER = ["--prefill-placement", "remote", "--heartbeat-timeout", "1.5", "--lease-interval", "0.3"]
PREFIX = list(range(100, 132))  # two blocks every prompt shares: prefix-cache hits
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve.json"

Scrape = dict[str, float]  # sample name and labels -> value


class Deployment:
    def __init__(self, cluster: LocalCluster, health: dict[str, int]) -> None:
        self.cluster, self.health = cluster, health

    def scrape(self, name: str) -> Scrape:
        """Every sample of one process ("router", "prefill0", "decode0"), labels dropped but
        for `connector`, `cause` and histogram `le`s (summed over the rest)."""
        url = self.cluster.url if name == "router" else f"http://127.0.0.1:{self.health[name]}"
        text = httpx.get(url + "/metrics", timeout=10).text
        out: Scrape = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                keep = {k: v for k, v in s.labels.items() if k in ("connector", "cause")}
                key = s.name + "".join(f"|{v}" for _, v in sorted(keep.items()))
                out[key] = out.get(key, 0.0) + s.value
        return out

    def families(self) -> set[str]:
        """Every metric family and sample name the three processes export."""
        names: set[str] = set()
        for name in ("router", *self.health):
            url = self.cluster.url if name == "router" else f"http://127.0.0.1:{self.health[name]}"
            text = httpx.get(url + "/metrics", timeout=10).text
            for family in text_string_to_metric_families(text):
                names |= {family.name, *(s.name for s in family.samples)}
        return names


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    model = make_tiny_model("llama", tmp_path_factory.mktemp("metrics") / "m", max_position=2048)
    health = {"prefill0": free_port(), "decode0": free_port()}
    nodes = {name: ["--health-port", str(port)] for name, port in health.items()}
    cluster = LocalCluster(
        str(model),
        1,
        1,
        engine_args=ENGINE,
        decode_args=DECODE,
        router_args=ROUTER,
        node_args=nodes,
    )
    with cluster:
        yield Deployment(cluster, health)


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 120) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def moved(before: Scrape, after: Scrape, *names: str) -> None:
    for name in names:
        assert after.get(name, 0.0) > before.get(name, 0.0), f"{name} did not move"


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def test_every_metric_moves_under_a_small_load(deployment: Deployment) -> None:
    procs = ("router", "prefill0", "decode0")
    before = {p: deployment.scrape(p) for p in procs}
    url = deployment.cluster.url
    assert complete(url, PREFIX + [1] * 16, 8).status_code == 200
    with ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(complete, url, PREFIX + [i] * 16, 112) for i in range(2, 8)]
        assert [a.result().status_code for a in answers] == [200] * 6
    wait_for(  # the node's counters go out with its next heartbeat
        lambda: deployment.scrape("prefill0")["pdserve:prefix_cache_hits_total"] > 0,
        "prefix-cache hits",
    )
    after = {p: deployment.scrape(p) for p in procs}
    moved(
        before["router"],
        after["router"],
        "pdserve:time_to_first_token_seconds_count",
        "pdserve:inter_token_latency_seconds_count",
        "pdserve:request_time_per_output_token_seconds_count",
        "pdserve:request_decode_time_seconds_count",
        "pdserve:e2e_request_latency_seconds_count",
    )
    assert after["router"]["pdserve:e2e_request_latency_seconds_count"] == 7
    moved(
        before["prefill0"],
        after["prefill0"],
        "pdserve:request_queue_time_seconds_count",
        "pdserve:request_prefill_time_seconds_count",
        "pdserve:prefix_cache_queries_total",
        "pdserve:prefix_cache_hits_total",
    )
    moved(
        before["decode0"],
        after["decode0"],
        "pdserve:request_queue_time_seconds_count",
        "pdserve:kv_transfer_time_seconds_count|zmq",
        "pdserve:kv_transfer_bytes_sum|zmq",
        "pdserve:num_preemptions_total",
    )
    assert after["decode0"]["pdserve:kv_transfer_bytes_count|zmq"] == 7  # one per request
    for name in ("prefill0", "decode0"):  # no fault yet: at zero, but exported
        assert after[name]["pdserve:kv_transfer_failures_total|zmq"] == 0
        assert after[name]["pdserve:lease_expirations_total"] == 0


def test_kv_cache_usage_is_up_while_a_request_runs(deployment: Deployment) -> None:
    """The gauges go out together with each heartbeat: a scrape of the decode node that counts
    a running request shows its blocks in use. Sampled while answers run; a load can end
    between two heartbeats on a fast machine, so another is sent until a sample caught one
    running (the assertion is on every such sample, however many there are)."""
    url = deployment.cluster.url
    running: list[float] = []  # the usage of each sample that counted a running request
    for attempt in range(5):
        with ThreadPoolExecutor(6) as pool:
            prompts = [PREFIX + [attempt * 8 + i] * 16 for i in range(40, 46)]
            answers = [pool.submit(complete, url, p, 112) for p in prompts]
            while not all(a.done() for a in answers):
                sample = deployment.scrape("decode0")
                if sample["pdserve_node_running_requests"] > 0:
                    running.append(sample["pdserve:kv_cache_usage_perc"])
        assert [a.result().status_code for a in answers] == [200] * 6
        if running:
            break
    assert running, "no scrape of five loads caught a running request"
    assert min(running) > 0, running


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Iterator[Deployment]:
    """A 1P1D pair whose prefill node corrupts every KV frame it sends (after its checksum:
    the test bed's fault plan, pdserve.testbed.kvfaults, which the suite's launcher installs
    in the nodes it forks, as a fresh interpreter's sitecustomize does)."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("damaged") / "m", max_position=2048)
    health = {"prefill0": free_port(), "decode0": free_port()}
    nodes = {name: ["--health-port", str(port)] for name, port in health.items()}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in kvfaults.child_env("targets=*").items():
            if value is None:
                mp.delenv(name, raising=False)
            else:
                mp.setenv(name, value)
        cluster = LocalCluster(
            str(model), 1, 1, engine_args=ENGINE, router_args=ROUTER, node_args=nodes
        )
        with cluster:
            yield Deployment(cluster, health)


def test_a_damaged_kv_transfer_is_counted_where_it_is_found(damaged: Deployment) -> None:
    """The decode node finds the damage (a slice's checksum) and counts each transfer of the
    request as failed on its /metrics; the router fails the request over by that cause (what
    the client gets at the end, a recomputed answer or an error, is tests/e2e/test_faults.py's
    to check). The prefill node's sends all went out: none failed there."""
    failed, cause = "pdserve:kv_transfer_failures_total|zmq", "pdserve:failovers_total|kv_failed"
    before = {p: damaged.scrape(p) for p in ("router", "prefill0", "decode0")}
    assert before["decode0"][failed] == 0 and before["router"].get(cause, 0.0) == 0
    complete(damaged.cluster.url, PREFIX + [9] * 16, 4)
    after = {p: damaged.scrape(p) for p in ("router", "prefill0", "decode0")}
    assert after["decode0"][failed] >= 1 and after["router"][cause] >= 1
    assert after["prefill0"][failed] == 0
    assert after["decode0"]["pdserve:kv_transfer_bytes_count|zmq"] == 0, "no transfer was whole"


def test_a_silent_decode_node_is_a_failover_by_its_cause(deployment: Deployment) -> None:
    cluster = deployment.cluster
    decode = cluster.procs["decode0"]
    key = "pdserve:failovers_total|node_gone"

    def failovers() -> float:
        return deployment.scrape("router").get(key, 0.0)

    before = failovers()
    body = {"prompt": PREFIX + [6] * 16, "max_tokens": LONG, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as answer:
        chunks = answer.iter_lines()
        # The second token is the decode node's: it holds the request, with hundreds of tokens
        # to go, when the node is stopped (a scrape of its gauges lags a heartbeat behind, and
        # a fast node had finished the answer by then).
        tokens = 0
        while tokens < 2:
            tokens += next(chunks).startswith("data: {")
        os.kill(decode.pid, signal.SIGSTOP)  # past the router's 1.5 s heartbeat timeout
        try:
            wait_for(lambda: failovers() > before, "failover")
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        for _ in chunks:  # another decode node there is none: an error, but an answer
            pass
    deployment.cluster.wait_ready(60)  # the node is back for what follows


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects. Raises ValueError on an expression that
    does not parse as far as this reads it: unbalanced brackets, an unknown word in a call
    position, a label list without its aggregation."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and format strings
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([5m], [$__rate_interval])
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    stack = []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if not stack or "([{"[")]}".index(ch)] != stack.pop():
                raise ValueError(f"unbalanced brackets in {expr!r}")
    if stack:
        raise ValueError(f"unbalanced brackets in {expr!r}")
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word, rest = match.group(), text[match.end() :].lstrip()
        if rest.startswith("("):
            if word not in PROMQL_CALLS:
                raise ValueError(f"unknown function {word!r} in {expr!r}")
        elif word not in ("and", "or", "unless", "bool", "offset"):
            names.add(word)
    return names


PROMQL_CALLS = {
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "rate", "irate",
    "increase", "delta", "histogram_quantile", "clamp_min", "clamp_max", "abs", "vector",
}  # fmt: skip


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_promql_names_are_read_from_an_expression() -> None:
    expr = 'sum by (le, stage) (rate(pdserve:x_bucket{role="p"}[$__rate_interval])) / on(a) b_c'
    assert promql_metric_names(expr) == {"pdserve:x_bucket", "b_c"}
    with pytest.raises(ValueError):
        promql_metric_names("sum(rate(x[5m])")
    with pytest.raises(ValueError):
        promql_metric_names("nosuchfunction(x)")


def test_the_dashboard_names_only_metrics_a_scrape_shows(deployment: Deployment) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    names = set().union(*(promql_metric_names(e) for e in exprs))
    exported = deployment.families()
    # A histogram's family name is exported with its suffixes; a counter's with `_total`.
    missing = {
        n for n in names if n not in exported and re.sub(r"_(bucket|sum|count|total)$", "", n)
        not in exported
    }  # fmt: skip
    assert not missing, f"the dashboard names metrics no process exports: {sorted(missing)}"

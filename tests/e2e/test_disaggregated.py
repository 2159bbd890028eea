"""Real processes on loopback: router + prefill + decode nodes, against the colocated engine.

Greedy completions through the router must equal the in-process colocated engine (itself
equal to HF transformers, see tests/common/test_llm_equivalence.py) token for token, and
every node's block pool must be clean afterwards.
"""

from __future__ import annotations

import contextlib
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.bench.systems import wait_until
from pdserve.common.engine.llm import LLM, SamplingParams
from pdserve.local_cluster import LocalCluster
from pdserve.testbed.cluster import HostCluster
from pdserve.testbed.faults import router_metrics
from pdserve.testbed.hosts import Hosts, skip_reason
from pdserve.tiny_model import make_tiny_model
from tests.devices import ON_CUDA, engine_flags, engine_kwargs
from tests.kv_transfer.helpers import needs_nixl

VOCAB = 512
MAX_TOKENS = 8
ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "96", "--max-model-len", "1100"]
ENGINE += engine_flags()  # PDSERVE_TEST_DEVICE=cuda: every node on the GPU


def make_prompts(n: int = 32, seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to 1000 tokens; a few share a 200-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    lengths = [1, 1000, 17, 333] + [rng.randrange(1, 700) for _ in range(n - 4)]
    prefix = [rng.randrange(VOCAB) for _ in range(200)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    for i in range(4, 10):
        prompts[i] = prefix + prompts[i][:50]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("e2e") / "m", max_position=2048))


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    llm = LLM(model_dir, block_size=16, **engine_kwargs())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


SEEDED = {"temperature": 1.0, "top_p": 0.9, "top_k": 50}  # sampled, seeded per request


@pytest.fixture(scope="module")
def seeded_reference(model_dir) -> list[list[int]]:
    # On the nodes' device: a seeded stream on CUDA is not the CPU's.
    llm = LLM(model_dir, block_size=16, **engine_kwargs())
    return [
        llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, seed=i, ignore_eos=True, **SEEDED))[
            0
        ].token_ids
        for i, p in enumerate(PROMPTS[:4])
    ]


def complete(url: str, prompt: list[int], **sampling) -> dict:
    import httpx

    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **sampling,
    }
    # Plain HTTP to the test's router: verify=False loads no CA bundle (the default client's
    # costs ~25 ms of CPU, and the e2e tests send hundreds of requests each through here).
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120, verify=False)
    assert resp.status_code == 200, resp.text
    return resp.json()


def run_concurrently(cluster: LocalCluster, prompts) -> list[dict]:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda p: complete(cluster.url, p), prompts))


def assert_clean(cluster: LocalCluster) -> None:
    assert_reports_clean(cluster.integrity(), len(cluster.procs) - 1)


def assert_reports_clean(reports: dict, num_nodes: int) -> None:
    """Every node answered the integrity check holding nothing, every block free, and the
    router has nothing in flight on it."""
    assert len(reports) == num_nodes, reports
    for node, info in reports.items():
        assert info["in_flight"] == 0, f"the router still waits on {node}"
        report = info["report"]
        assert report is not None, f"{node} did not answer the integrity check"
        assert report["ok"], f"{node}: {report['detail']}"
        assert report["live_requests"] == [], f"{node} still holds {report['live_requests']}"
        assert report["free_blocks"] == report["num_blocks"], f"{node} leaked blocks"


def _nccl():
    """NCCL puts no two ranks of one communicator on one GPU: a CUDA run needs two."""
    marks = ()
    if ON_CUDA:
        import torch

        if torch.cuda.device_count() < 2:
            marks = pytest.mark.skip(reason="NCCL cannot pair two ranks on one GPU")
    return pytest.param("nccl", 1, 1, marks=marks, id="nccl-1-1")


def _nixl(num_p: int, num_d: int):
    """A nixl case, run where the nixl extra is installed (CI installs it)."""
    return pytest.param("nixl", num_p, num_d, marks=needs_nixl, id=f"nixl-{num_p}-{num_d}")


@contextlib.contextmanager
def deployment(model_dir: str, connector: str, num_p: int, num_d: int, logs: str):
    """The cluster a case runs on: one prefill and one decode node on two hosts (network
    namespaces, `pdserve.testbed.hosts`) where this machine can build them and the connector
    crosses hosts; on loopback otherwise. Yields the router's URL and a check that every
    node's pool is clean."""
    # Network namespaces on a CPU machine only: one GPU's nodes run on one host (loopback).
    if num_p == num_d == 1 and connector != "shm" and not ON_CUDA and skip_reason() is None:
        with Hosts(["router", "prefill", "decode"]) as hosts:
            c = HostCluster(hosts, model_dir, logs, ENGINE)
            try:
                url = c.router("router")
                nodes = [
                    c.node(role, role, ["router"], connector) for role in ("prefill", "decode")
                ]
                c.wait_ready("router", nodes)
                yield url, lambda: assert_reports_clean(c.integrity("router"), 2)
            finally:
                c.close()
        return
    with LocalCluster(model_dir, num_p, num_d, kv_connector=connector, engine_args=ENGINE) as c:
        yield c.url, lambda: assert_clean(c)


@pytest.mark.parametrize(
    "connector,num_p,num_d",
    [("zmq", 1, 1), _nccl(), ("shm", 1, 1), ("zmq", 2, 2), _nixl(1, 1), _nixl(2, 2)],
)
def test_disaggregated_greedy_equals_colocated(
    model_dir, reference, seeded_reference, connector, num_p, num_d, tmp_path
):
    """1P1D runs across two hosts (zmq, nccl, nixl; shm needs one host), the rest on
    loopback: see `deployment`."""
    with deployment(model_dir, connector, num_p, num_d, str(tmp_path)) as (url, check_clean):
        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: complete(url, p), PROMPTS))
        got = [r["choices"][0]["token_ids"] for r in results]
        for i, (g, want) in enumerate(zip(got, reference)):
            assert g == want, f"prompt {i} (len {len(PROMPTS[i])}) via {connector}"
        # A seeded request samples its first token on P and the rest on D: one random stream.
        for i, want in enumerate(seeded_reference):
            seeded = complete(url, PROMPTS[i], seed=i, **SEEDED)
            assert seeded["choices"][0]["token_ids"] == want, f"seeded prompt {i}"
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results]
        again = complete(url, PROMPTS[1])  # the 1000-token prompt, now cached on P
        assert again["choices"][0]["token_ids"] == reference[1]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 992 or num_p > 1
        assert sum(cached) > 0 or num_p > 1
        check_clean()


def test_colocated_node_through_router(model_dir, reference):
    with LocalCluster(model_dir, 0, 0, num_colocated=1, engine_args=ENGINE) as c:
        results = run_concurrently(c, PROMPTS[:12])
        assert [r["choices"][0]["token_ids"] for r in results] == reference[:12]
        assert_clean(c)


def test_layout_mismatch_is_refused_with_a_clear_error(model_dir):
    """Nodes whose KV layouts differ make no route: the router is not ready, and a request
    gets a 503 naming what differs (before any KV moves)."""
    import httpx

    c = LocalCluster(
        model_dir,
        1,
        1,
        engine_args=["--max-model-len", "1100"],
        prefill_args=["--block-size", "32"],
        decode_args=["--block-size", "16"],
    )
    try:
        c.start(routable=False)
        assert httpx.get(c.url + "/health", timeout=10).status_code == 503
        resp = httpx.post(
            c.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60
        )
        assert resp.status_code == 503
        assert "block_size: prefill 32 != decode 16" in resp.text, resp.text
        assert_clean(c)
    finally:
        c.stop()


def test_openai_client_and_demo_against_1p1d(model_dir, capsys, monkeypatch):
    """The openai client's completions and chats, whole and streamed, then `run_demo`'s own
    questions, on one 1P1D deployment: the demo's (`demo.deployment`), checked before the demo
    asks (a second cluster for the client alone cost a start and a model load per node)."""
    from pdserve import demo

    real_deployment = demo.deployment

    @contextlib.contextmanager
    def checked_first(*args):
        with real_deployment(*args) as (cluster, client, name):
            assert_openai_client_answers(client, name)
            assert_clean(cluster)
            yield cluster, client, name

    monkeypatch.setattr(demo, "deployment", checked_first)
    results = demo.run_demo(model_dir, max_tokens=6, kv_connector="zmq", log_dir=None)
    asked = len(demo.QUESTIONS) + len(demo.COMPLETIONS)  # the demo's chats and completions
    assert len(results) == asked and all(r["tokens"] >= 1 for r in results)
    assert "block pools clean on every node" in capsys.readouterr().out


def assert_openai_client_answers(client, name: str) -> None:
    """A completion and a chat each equal whether streamed or not."""
    fields = dict(model=name, max_tokens=6, temperature=0)
    ask = dict(prompt="hello there", extra_body={"ignore_eos": True}, **fields)
    whole = client.completions.create(**ask)
    pieces = client.completions.create(stream=True, **ask)
    assert "".join(ch.choices[0].text for ch in pieces if ch.choices) == whole.choices[0].text
    assert whole.usage.completion_tokens == 6
    messages = [{"role": "user", "content": "hi"}]
    fields["max_tokens"] = 5
    chat = client.chat.completions.create(messages=messages, **fields)
    streamed = client.chat.completions.create(messages=messages, stream=True, **fields)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == chat.choices[0].message.content


@pytest.mark.parametrize("policy", ["prefix_aware", "least_loaded"])
def test_prefix_aware_routing_sends_a_prompt_to_the_node_holding_its_prefix(model_dir, policy):
    """Four fresh 200-token prefixes spread over two prefill nodes; a follow-up of each must
    then hit that node's prefix cache. least_loaded (which ignores caches) is the control:
    with idle nodes it sends every follow-up to the same node, so some of them miss."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(4)]
    args = ["--policy", policy]
    with LocalCluster(model_dir, 2, 1, engine_args=ENGINE, router_args=args) as c:
        run_concurrently(c, [p + [1, 2, 3] for p in prefixes])
        full_blocks = 4 * (203 // 16)  # the nodes' heartbeats report what they cached
        reported = lambda: router_metrics(c.url)["prefix_blocks_prefill"] >= full_blocks  # noqa: E731
        wait_until(reported, c.procs, 30.0, "the prefill nodes' prefix reports")
        cached = [
            complete(c.url, p + [4, 5])["usage"]["prompt_tokens_details"]["cached_tokens"]
            for p in prefixes
        ]
        reports = c.integrity()
        holders = [n for n, r in reports.items() if r["role"] == "prefill"]
        assert all(reports[n]["report"]["cached_blocks"] > 0 for n in holders)  # spread
        if policy == "prefix_aware":
            assert cached == [192] * 4, cached
        else:
            assert min(cached) == 0, cached
        assert_clean(c)

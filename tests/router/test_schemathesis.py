"""schemathesis against the router's own OpenAPI schema: no input gives a 5xx, and every
error comes in vLLM's envelope.

Two runs: many cases against the app over FakeBackend (in-process, fast), then fewer against a
real `python -m router` process with a colocated tiny node, API key on. Generated cases ask
for at most a few tokens, so each answer is quick: the fuzzed copy of the schema caps
max_tokens, n and the prompts per request (the served schema keeps the real bounds). Cases
are drawn with Hypothesis from schemathesis' strategies directly, since its pytest plugin
(`schema.parametrize()`) does not run under pytest 9.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from pdserve.local_cluster import LocalCluster
from pdserve.router.app import create_app
from tests.router.fake_backend import ERROR_FIELDS, FakeBackend, tiny_tokenizer

MODEL = "tiny-llama"
API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 4  # generated cases ask for no more than this, and n no more than MAX_N
MAX_N = 2
MAX_PROMPTS = 2
REAL_MAX_MODEL_LEN = 24  # so a case that leaves max_tokens out still answers quickly
IN_PROCESS_EXAMPLES = 40  # per operation and per mode (valid, invalid)
REAL_EXAMPLES = 6
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/live"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


def fuzz_schema(served: dict[str, Any], model: str) -> dict[str, Any]:
    """A copy of the served schema with generation bounds (tokens, choices, prompts)
    tightened for speed, and valid cases naming the served model (a random name would only
    ever get 404)."""
    schema = copy.deepcopy(served)
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = components[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in fields:
                _cap(fields[field], MAX_TOKENS)
        _cap(fields["n"], MAX_N)
    for variant in components["CompletionRequest"]["properties"]["prompt"]["oneOf"]:
        if variant["type"] == "array" and variant["items"].get("type") != "integer":
            variant["maxItems"] = MAX_PROMPTS  # a batch of prompts, each with n choices
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest"):
        components[name]["properties"]["model"] = {"enum": [model, None]}
    return schema


def _cap(field: dict[str, Any], maximum: int) -> None:
    for variant in field.get("anyOf", [field]):
        if variant.get("type") == "integer":
            variant["maximum"] = maximum


def check_envelope(response: Any) -> None:
    """No 5xx, and an error body is exactly vLLM's envelope with the status as its code."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = json.loads(response.text)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
        assert body["error"]["code"] == response.status_code, body


def fuzz(schema: Any, method: str, path: str, max_examples: int, **call_kwargs: Any) -> None:
    """Up to max_examples valid and as many invalid cases of one operation, each checked."""
    operation = schema[path][method]
    # A route without a body or parameters has no invalid input to generate.
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if method == "POST" else []
    for mode in modes or [GenerationMode.POSITIVE]:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=True,  # the same cases every run: a failure here is a real one
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            check_envelope(case.call(headers=AUTH, **call_kwargs))

        run()


def load(served: dict[str, Any], model: str, **where: Any) -> Any:
    """The fuzzed schema, set to call where (app= or base_url=), with the key as a header
    rather than generated, so every case reaches the route's own validation."""
    schema = schemathesis.openapi.from_dict(fuzz_schema(served, model))
    schema.config.generation.update(with_security_parameters=False)
    if "app" in where:
        schema.app = where["app"]
    else:
        schema.config.update(base_url=where["base_url"])
    return schema


def test_the_schema_lists_every_operation(fake_app: Any) -> None:
    schema = load(fake_app.openapi(), MODEL, app=fake_app)
    found = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert found == set(OPERATIONS)


# ---------------------------------------------------------------- in-process, FakeBackend


@pytest.fixture(scope="module")
def fake_app() -> Any:
    tokenizer = tiny_tokenizer()
    backend = FakeBackend(len(tokenizer), tokenizer.eos_token_id, max_model_len=64)
    return create_app(backend, tokenizer, MODEL, api_key=API_KEY)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_fuzzed_requests_in_process(fake_app: Any, method: str, path: str) -> None:
    fuzz(load(fake_app.openapi(), MODEL, app=fake_app), method, path, IN_PROCESS_EXAMPLES)


# ---------------------------------------------------------------- a real router process


@pytest.fixture(scope="module")
def real_cluster(tiny_model_dir: Any) -> Iterator[LocalCluster]:
    model = str(tiny_model_dir("llama"))
    router_args = ["--max-model-len", str(REAL_MAX_MODEL_LEN), "--api-key", API_KEY]
    router_args += ["--max-queued-requests", "2"]
    cluster = LocalCluster(model, 0, 0, num_colocated=1, router_args=router_args)
    # LocalCluster polls /internal/integrity without a key; this one needs it.
    cluster.integrity = lambda: _integrity(cluster)  # type: ignore[method-assign]
    with cluster:
        yield cluster


def _integrity(cluster: LocalCluster) -> dict:
    response = httpx.get(cluster.url + "/internal/integrity", headers=AUTH, timeout=10)
    return response.json() if response.status_code == 200 else {}


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_fuzzed_requests_against_a_real_router(
    real_cluster: LocalCluster, method: str, path: str
) -> None:
    served = httpx.get(real_cluster.url + "/openapi.json", headers=AUTH, timeout=10).json()
    models = httpx.get(real_cluster.url + "/v1/models", headers=AUTH, timeout=10).json()
    schema = load(served, models["data"][0]["id"], base_url=real_cluster.url)
    fuzz(schema, method, path, REAL_EXAMPLES, timeout=30)


def test_real_router_refuses_beyond_its_queue_and_finishes_the_rest(
    real_cluster: LocalCluster,
) -> None:
    tokens = REAL_MAX_MODEL_LEN - 4  # as long as the context allows: admitted ones overlap
    body = {"prompt": "hello", "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    results: list[httpx.Response] = []

    def post() -> None:
        url = real_cluster.url + "/v1/completions"
        results.append(httpx.post(url, json=body, headers=AUTH, timeout=60))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    statuses = sorted(r.status_code for r in results)
    assert len(results) == 8 and set(statuses) <= {200, 503}, statuses
    assert 1 <= statuses.count(200) and statuses.count(503) >= 1, statuses
    for response in results:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == tokens
        else:
            assert response.headers["retry-after"] == "1"
            assert "--max-queued-requests" in response.json()["error"]["message"]
    for node in _integrity(real_cluster).values():
        assert node["report"]["ok"], node


def test_real_router_needs_its_key(real_cluster: LocalCluster) -> None:
    for path in ("/openapi.json", "/v1/models", "/metrics", "/internal/integrity", "/nope"):
        response = httpx.get(real_cluster.url + path, timeout=10)
        assert response.status_code == 401, (path, response.text)
    assert httpx.get(real_cluster.url + "/health", timeout=10).status_code == 200

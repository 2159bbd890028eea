"""Structured outputs through real processes: colocated, 1P1D and 2P2D give the in-process
engine's greedy output token for token under every kind of constraint, a stream resumed after
its decode node was killed ends the same and still valid, and a constraint that cannot
compile is a 400 that leaves no block held."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from pdserve.common.engine.llm import LLM
from pdserve.common.wire.payloads import SamplingParams, StructuredOutputsParams
from pdserve.local_cluster import LocalCluster
from pdserve.tiny_model import make_tiny_model

ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "64", "--max-model-len", "1024"]
ENGINE += ["--dtype", "float32"]  # as the offline reference
PROMPT = "Describe a person as JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue and more"]

# (request fields, the same constraint as StructuredOutputsParams)
CASES = {
    "response_format json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA},
            }
        },
        StructuredOutputsParams(json=SCHEMA),
    ),
    "response_format json_object": (
        {"response_format": {"type": "json_object"}},
        StructuredOutputsParams(json_object=True),
    ),
    "structured_outputs regex": (
        {"structured_outputs": {"regex": REGEX}},
        StructuredOutputsParams(regex=REGEX),
    ),
    "structured_outputs choice": (
        {"structured_outputs": {"choice": CHOICES}},
        StructuredOutputsParams(choice=tuple(CHOICES)),
    ),
    "guided_grammar": (
        {"guided_grammar": 'root ::= "x" [0-9] [0-9] "y"'},
        StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9] "y"'),
    ),
    "guided_json": ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("so") / "m", max_position=2048))


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, tuple[list[int], str, str]]:
    """Greedy token ids, text and finish reason of each case from the in-process engine."""
    llm = LLM(model_dir, block_size=16, dtype="float32")
    out = {}
    for name, (_, so) in CASES.items():
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=so)
        (o,) = llm.generate([PROMPT], params)
        out[name] = (o.token_ids, o.text, o.finish_reason)
    return out


def complete(url: str, fields: dict, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **fields, **extra}
    resp = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def check_valid(name: str, text: str, finish: str) -> None:
    if finish != "stop":
        return  # cut off by max_tokens: not complete, nothing to check
    if "json" in name:
        value = json.loads(text)
        assert isinstance(value, dict)
        if "schema" in name or name == "guided_json":
            assert set(value) == {"name", "age", "tags"} and 0 <= value["age"] <= 120
    elif "regex" in name:
        assert re.fullmatch(REGEX, text), text
    elif "choice" in name:
        assert text in CHOICES
    else:
        assert re.fullmatch(r"x[0-9]{2}y", text), text


def test_reference_outputs_follow_their_constraints(reference):
    finished = 0
    for name, (_, text, finish) in reference.items():
        check_valid(name, text, finish)
        finished += finish == "stop"
    assert finished >= 4, reference  # most cases end inside the budget, so they are checked


SHAPES = {"colocated": (0, 0, 1), "1P1D": (1, 1, 0), "2P2D": (2, 2, 0)}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_mode_gives_the_engine_s_output(model_dir, reference, shape):
    """Each case equals the engine; bad input leaves nothing held; in 2P2D (one cluster start
    for both, ~10 s each here) a stream also survives the kill of its decode node."""
    p, d, c = SHAPES[shape]
    engine = [*ENGINE, "--heartbeat-interval", "0.2"]
    router = ["--heartbeat-timeout", "1.5", "--lease-interval", "0.3"]
    with LocalCluster(
        model_dir, p, d, num_colocated=c, engine_args=engine, router_args=router
    ) as cluster:
        for name, (fields, _) in CASES.items():
            choice = complete(cluster.url, fields)
            want_ids, want_text, want_finish = reference[name]
            assert choice["token_ids"] == want_ids, name
            assert (choice["text"], choice["finish_reason"]) == (want_text, want_finish), name
            check_valid(name, choice["text"], choice["finish_reason"])
        bad_input_leaves_nothing_held(cluster)
        if shape == "2P2D":
            resumed_after_its_decode_node_died(cluster, reference)


def bad_input_leaves_nothing_held(cluster: LocalCluster) -> None:
    bad = {
        "a schema xgrammar rejects": {"guided_json": {"type": "object", "properties": 3}},
        "a regex that does not parse": {"structured_outputs": {"regex": "(ab"}},
        "a grammar without root": {"guided_grammar": 'start ::= "a"'},
        "two constraints": {"guided_regex": "a+", "response_format": {"type": "json_object"}},
        "two inside structured_outputs": {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "an unknown constraint": {"structured_outputs": {"structural_tag": "x"}},
        "json_schema without its schema": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}
        },
    }
    for what, fields in bad.items():
        body = {"prompt": PROMPT, "max_tokens": 4, **fields}
        resp = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, (what, resp.status_code, resp.text)
        assert resp.json()["error"]["type"] == "BadRequestError", what
    for node, info in cluster.integrity().items():
        report = info["report"]
        assert report["ok"] and not report["live_requests"], (node, report)
        assert report["free_blocks"] == report["num_blocks"], f"{node} holds blocks"


def resumed_after_its_decode_node_died(cluster: LocalCluster, reference) -> None:
    """The decode node streaming a JSON-schema answer is killed after a few tokens; the router
    resumes the request on the other decode node, which rebuilds the grammar matcher from the
    tokens already streamed. The text is the one without the fault, and valid."""
    name = "response_format json_schema"
    fields, _ = CASES[name]
    want_ids, want_text, _ = reference[name]
    assert len(want_ids) > 8, "the case must stream long enough to be cut"
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    body |= {"stream": True, "return_token_ids": True, "ignore_eos": False}
    got: list[int] = []
    text = ""
    killed = threading.Event()
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                got += c.get("token_ids") or []
                text += c.get("text") or ""
            if len(got) >= 4 and not killed.is_set():
                victim = decode_node_of(cluster)
                cluster.procs[victim].kill()
                killed.set()
    assert killed.is_set()
    assert got == want_ids
    assert text == want_text
    check_valid(name, text, "stop")


def decode_node_of(cluster: LocalCluster) -> str:
    """The decode node holding the one running request (its integrity report says so)."""
    for node, info in cluster.integrity().items():
        if node.startswith("decode") and info["report"] and info["report"]["live_requests"]:
            return node
    raise AssertionError("no decode node holds the request")

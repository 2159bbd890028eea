"""pdserve bench serve (scripts/bench_serving.py): metrics logic on made-up results, request
probing against a stand-in for transformers serve, and the CLI and core against a real
colocated pdserve cluster."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.bench import load as ld
from pdserve.bench import serve as bs
from pdserve.local_cluster import LocalCluster, free_port

DISTRIBUTIONS = ("ttft", "tpot", "itl", "e2el")
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "requests",
    "server",
)


# ---------------------------------------------------------------- pure logic


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert ld.percentile(xs, 0) == 1.0
    assert ld.percentile(xs, 100) == 4.0
    assert ld.percentile(xs, 50) == 2.5
    assert ld.percentile(xs, 99) == pytest.approx(3.97)
    assert math.isnan(ld.percentile([], 50))


def test_poisson_arrivals_are_seeded_and_inf_sends_all_at_once():
    assert ld.poisson_arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    a = ld.poisson_arrivals(2000, 5.0, 7)
    assert a == ld.poisson_arrivals(2000, 5.0, 7)
    assert a != ld.poisson_arrivals(2000, 5.0, 8)
    assert a == sorted(a) and a[0] == 0.0
    assert a[-1] / (len(a) - 1) == pytest.approx(1 / 5.0, rel=0.1)  # mean gap 1/rate


def test_goodput_counts_requests_within_every_slo():
    def result(ttft: float, e2e: float, out: int) -> ld.RequestResult:
        return ld.RequestResult(
            success=True, prompt_tokens=10, output_tokens=out, ttft=ttft, e2e=e2e, itl=[0.01]
        )

    results = [result(0.1, 1.1, 11), result(0.5, 1.5, 11), result(0.1, 3.1, 11)]
    results.append(ld.RequestResult(error="HTTP 503"))
    config = ld.BenchConfig("http://x", goodput={"ttft": 200.0, "tpot": 150.0})
    out = ld.summarize(results, duration=2.0, config=config)
    # TPOTs are 0.1, 0.1 and 0.3 s: only the first request meets both SLOs.
    assert out["completed"] == 3 and out["failed"] == 1
    assert out["errors"] == ["HTTP 503"]
    assert out["request_goodput"] == pytest.approx(0.5)
    assert out["request_throughput"] == pytest.approx(1.5)
    assert out["output_throughput"] == pytest.approx(33 / 2)
    assert out["mean_tpot_ms"] == pytest.approx(500 / 3)
    assert ld.summarize(results, 2.0, ld.BenchConfig("http://x"))["request_goodput"] is None


def test_bad_cli_values_are_refused():
    assert bs.parse_goodput(["ttft:500", "e2el:9000"]) == {"ttft": 500.0, "e2el": 9000.0}
    with pytest.raises(ValueError, match="bad --goodput"):
        bs.parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="request_rate"):
        ld.BenchConfig("http://x", request_rate=0)
    with pytest.raises(ValueError, match="goodput"):
        ld.BenchConfig("http://x", goodput={"itl": 5.0})


def test_structured_requests_are_drawn_and_checked():
    reqs = [ld.BenchRequest([1, 2], None, 2, 4) for _ in range(200)]
    mixed = bs.with_structured(reqs, "choice", 0.25, seed=4)
    assert mixed == bs.with_structured(reqs, "choice", 0.25, seed=4)
    on = [r for r in mixed if r.structured == "choice"]
    assert 30 <= len(on) <= 70 and all(r.tag == "structured" for r in on)
    assert all(r.tag == "free" and r.structured is None for r in mixed if r not in on)
    assert all(r.structured == "json" for r in bs.with_structured(reqs[:5], "json"))
    with pytest.raises(ValueError, match="unknown structured"):
        bs.with_structured(reqs, "yaml")
    with pytest.raises(ValueError, match="ratio"):
        bs.with_structured(reqs, "json", 1.5)
    person = {"name": "Ada", "age": 36, "role": "admin", "tags": ["x"]}
    assert ld.structured_valid("json", json.dumps(person))
    assert not ld.structured_valid("json", json.dumps(person)[:-1])  # cut off
    assert not ld.structured_valid("json", json.dumps({**person, "role": "root"}))
    assert ld.structured_valid("json_object", '{"a": [1]}')
    assert not ld.structured_valid("json_object", "[1]")
    assert ld.structured_valid("regex", "Abc-123") and not ld.structured_valid("regex", "abc-1")
    assert ld.structured_valid("choice", "neutral") and not ld.structured_valid("choice", "no")
    body = ld.request_body(on[0], ld.ServerCaps(True, "ignore_eos", None), 0.0)
    assert body["structured_outputs"] == {"choice": list(ld.BENCH_CHOICES)}


@pytest.fixture(scope="module")
def pool(tiny_model_dir) -> ld.TokenPool:
    return ld.load_pool(str(tiny_model_dir("llama")))


def test_text_prompts_keep_their_token_count(pool):
    import random

    rng = random.Random(0)
    for n in (1, 7, 64, 200):
        assert len(pool.encode(pool.text(rng, n))) == n
    reqs = ld.random_requests(pool, 5, 40, 8, range_ratio=0.5, seed=3)
    assert reqs == ld.random_requests(pool, 5, 40, 8, range_ratio=0.5, seed=3)
    assert all(20 <= r.prompt_len <= 60 and len(r.prompt) == r.prompt_len for r in reqs)
    texts = ld.as_text(pool, reqs)
    assert all(isinstance(t.prompt, str) for t in texts)
    assert [t.prompt_len for t in texts] == [r.prompt_len for r in reqs]
    assert [len(pool.encode(t.prompt)) for t in texts] == [r.prompt_len for r in reqs]


def test_chat_turns_carry_the_conversation_so_far(pool):
    w = ld.ChatWorkload(2, 3, 20, 10, answer_len=4, system_len=30, exact=False, seed=1)
    turns = ld.chat_turns(pool, w)
    assert turns == ld.chat_turns(pool, w)
    assert [[r.conversation for r in t] for t in turns] == [[0, 1]] * 3
    first, later = turns[0][0], turns[2][0]
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert turns[0][0].messages[0] == turns[0][1].messages[0]  # one system prompt for all
    assert [m["role"] for m in later.messages] == ["user"]
    caps = ld.ServerCaps(False, "ignore_eos", None)
    history = [*first.messages, {"role": "assistant", "content": "an answer"}]
    body = ld.request_body(later, caps, 0.0, history)
    assert body["messages"] == [*history, *later.messages]  # the next turns carry the earlier
    assert body["min_tokens"] == later.output_len  # ignore_eos mode: both, for llama.cpp
    assert "min_tokens" not in ld.request_body(later, replace(caps, eos_mode="none"), 0.0)
    assert ld.request_body(turns[1][1], caps, 0.0)["stream_options"] == {"include_usage": True}


# ---------------------------------------------------------------- probing, text-only server


def _text_only_app() -> FastAPI:
    """Answers like transformers serve: 422 on fields it does not know, 400 on id prompts,
    a 500 from /v1/models, streams with usage in the last chunk."""
    known = {"prompt", "max_tokens", "temperature", "stream", "stream_options", "model"}
    known |= {"generation_config", "seed"}
    app = FastAPI()
    app.state.bodies = []

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"detail": "no cache"}, 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        app.state.bodies.append(body)
        if set(body) - known:
            return JSONResponse({"detail": f"Unexpected fields {set(body) - known}"}, 422)
        if not isinstance(body["prompt"], str):
            return JSONResponse({"detail": "prompt must be a string."}, 400)
        n = body["max_tokens"]
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "x" * n}], "usage": {"prompt_tokens": 3}})

        async def events() -> AsyncIterator[str]:
            for _ in range(n):
                yield f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def text_only_server() -> Iterator[tuple[str, object]]:
    import uvicorn

    app = _text_only_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.05)
    assert server.started, "stand-in server did not start"
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(10)


def test_text_only_server_gets_text_prompts_and_generation_config(pool, text_only_server):
    url, app = text_only_server
    reqs = ld.random_requests(pool, 4, 12, 5, seed=2)
    out = ld.run_benchmark(ld.BenchConfig(url, disable_tqdm=True), reqs, pool)
    assert out["server"] == {"token_ids": False, "eos_mode": "generation_config", "model": None}
    assert out["completed"] == 4 and out["failed"] == 0
    assert out["total_output_tokens"] == 20
    timed = app.state.bodies[-4:]
    assert all(isinstance(b["prompt"], str) and "ignore_eos" not in b for b in timed)
    assert all(json.loads(b["generation_config"])["eos_token_id"] == -1 for b in timed)


# ---------------------------------------------------------------- against pdserve


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[tuple[LocalCluster, Path]]:
    model = tiny_model_dir("llama")
    with LocalCluster(str(model), 0, 0, num_colocated=1) as c:
        yield c, model


def _check_summary(out: dict, n: int) -> None:
    for key in SUMMARY_KEYS:
        assert key in out, key
    assert out["completed"] == n and out["failed"] == 0, out["errors"]
    assert len(out["requests"]) == n
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert math.isfinite(out[key]) and out[key] > 0, key
    assert out["total_token_throughput"] > out["output_throughput"]
    for name in DISTRIBUTIONS:
        mean, median = out[f"mean_{name}_ms"], out[f"median_{name}_ms"]
        p50, p90, p99 = (out[f"p{q}_{name}_ms"] for q in (50, 90, 99))
        assert all(math.isfinite(v) and v > 0 for v in (mean, median, p90, p99)), name
        assert median == p50 and median <= p90 <= p99, name
    ttfts = [r["ttft_s"] * 1000 for r in out["requests"]]
    assert min(ttfts) <= out["mean_ttft_ms"] <= max(ttfts)
    assert out["p99_ttft_ms"] <= max(ttfts)
    for r in out["requests"]:
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["start_s"] >= 0


def test_cli_against_colocated_pdserve(cluster, tmp_path):
    c, model = cluster
    path = tmp_path / "result.json"
    argv = [
        *("--base-url", c.url, "--tokenizer", str(model), "--num-prompts", "6"),
        *("--input-len", "32", "--output-len", "6", "--range-ratio", "0.5"),
        *("--request-rate", "20", "--max-concurrency", "4", "--seed", "1"),
        *("--goodput", "ttft:1000", "tpot:1000", "--result-file", str(path), "--disable-tqdm"),
    ]
    returned = bs.main(argv)
    out = json.loads(path.read_text())
    assert out["completed"] == returned["completed"]
    _check_summary(out, 6)
    # The served name is MODEL as given to the router (vLLM's rule).
    assert out["server"] == {"token_ids": True, "eos_mode": "ignore_eos", "model": str(model)}
    # ignore_eos and token-id prompts: the server's usage equals what was asked for.
    assert out["input_len_mismatches"] == 0 and out["output_len_mismatches"] == 0
    assert out["usage_missing"] == 0
    assert 0 <= out["request_goodput"] <= out["request_throughput"]
    assert out["max_concurrency"] == 4 and out["request_rate"] == 20


def test_quick_mode_against_colocated_pdserve(cluster, tmp_path):
    c, model = cluster
    path = tmp_path / "quick.json"
    argv = ["--base-url", c.url, "--tokenizer", str(model), "--quick", "--disable-tqdm"]
    bs.main([*argv, "--result-file", str(path)])
    out = json.loads(path.read_text())
    _check_summary(out, bs.QUICK["num_prompts"])


def test_multiturn_core_against_colocated_pdserve(cluster, pool):
    c, _ = cluster
    w = ld.ChatWorkload(2, 2, 24, 24, answer_len=4, system_len=40, exact=False, seed=5)
    reqs = [r for turn in ld.chat_turns(pool, w) for r in turn]
    config = ld.BenchConfig(c.url, disable_tqdm=True, goodput={"e2el": 1e-3})
    out = ld.run_benchmark(config, reqs, pool)
    _check_summary(out, 4)
    assert out["request_goodput"] == 0  # nothing ends within a microsecond
    assert out["output_len_mismatches"] == 0
    assert out["cached_prompt_tokens"] > 0  # second turns reuse the first turns' blocks
    by_conv: dict[int, list[dict]] = {}
    for r in out["requests"]:
        by_conv.setdefault(r["conversation"], []).append(r)
    for first, second in by_conv.values():  # a turn waits for the previous one to finish
        assert second["start_s"] >= first["start_s"] + first["e2e_s"]
        # The second turn's prompt holds the first's prompt and its real answer.
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]
        assert first["text"]


def test_structured_mode_against_colocated_pdserve(cluster, tmp_path):
    """Half the requests constrained, half free, in one run; every constrained output is
    what its constraint asks for (the tiny random model's text, masked)."""
    c, model = cluster
    path = tmp_path / "structured.json"
    argv = [
        *("--base-url", c.url, "--tokenizer", str(model), "--num-prompts", "8"),
        *("--input-len", "24", "--output-len", "24", "--structured-output", "regex"),
        *("--structured-output-ratio", "0.5", "--seed", "3", "--num-warmups", "0"),
        *("--result-file", str(path), "--disable-tqdm"),
    ]
    bs.main(argv)
    out = json.loads(path.read_text())
    assert out["completed"] == 8 and out["failed"] == 0, out["errors"]
    tags = out["by_tag"]
    assert set(tags) == {"structured", "free"}
    n = tags["structured"]["completed"]
    assert 0 < n < 8 and tags["free"]["completed"] == 8 - n
    assert out["structured_valid"] == n and out["structured_invalid"] == 0
    for r in out["requests"]:
        if r["structured"]:
            assert ld.structured_valid("regex", r["text"]), r["text"]
            assert r["output_tokens"] < 24  # the grammar ended it, ignore_eos or not
        else:
            assert r["text"] is None and r["output_tokens"] == 24

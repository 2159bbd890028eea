"""Serving benchmark: stream requests at any OpenAI-compatible server, report what
`vllm bench serve` reports (throughput, TTFT, TPOT, ITL, E2E latency, goodput).

    pdserve bench serve --base-url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --dataset random --num-prompts 64 --input-len 512 --output-len 128 \\
        --request-rate 2 --goodput ttft:2000 tpot:200 --result-file result.json

(`python scripts/bench_serving.py ...` is the same, as the docs cite it.)

Requests arrive as a Poisson process at `--request-rate` (inf: all at once), at most
`--max-concurrency` in flight. Lengths are drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)] with `--seed`, so every server gets the
same requests. Datasets:

- `random`: /v1/completions; the prompt is token ids when the server takes them (pdserve,
  vLLM), else text built from the tokenizer to the same length (transformers serve).
- `multiturn`: /v1/chat/completions; synthetic conversations that share a system prompt, each
  turn carrying the whole history before it, so turns share prefixes; a conversation's next
  turn is sent only once its previous one has finished.

Structured outputs: `--structured-output json|json_object|regex|choice` constrains a share of
the requests (`--structured-output-ratio`, drawn with `--seed`) with vLLM's
`structured_outputs` field (OpenAI's `response_format` for json_object). Constrained and free
requests run side by side in one run and are reported apart (`by_tag`: "structured", "free"),
with how many constrained outputs the constraint accepts (a cut-off JSON counts as invalid).

Before timing, one probe finds what the server accepts, in this order: token-id prompts,
`ignore_eos` (pdserve, vLLM), transformers serve's `generation_config` with EOS switched off;
so output lengths hold wherever the server can be told to. Input and output lengths are the
server's own `usage` counts, not the ones asked for; the result says how many differ.

Every request streams (SSE). TTFT: request sent until the first chunk carrying text. ITL:
gaps between text chunks (a server may put several tokens in one chunk, or hold back a token
that ends inside a UTF-8 character). TPOT: (E2E - TTFT) / (output tokens - 1). The core,
`run_benchmark(config, requests) -> dict`, is what `pdserve bench compare` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pdserve.common.node.cli import parser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Goodput SLO names, as vLLM's --goodput takes them.
SLO_METRICS = ("ttft", "tpot", "e2el")
# EOS handling the probe may find: none, vLLM/pdserve's field, transformers serve's config.
EOS_MODES = ("ignore_eos", "generation_config", "none")
PROBE_ATTEMPTS = 3

# --structured-output kinds: the request fields each adds. The schema's strings and list are
# bounded, so a conforming object ends well within 100 tokens of a small model's vocabulary.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
BENCH_REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
BENCH_CHOICES = ("positive", "negative", "neutral")
STRUCTURED_FIELDS: dict[str, dict[str, Any]] = {
    "json": {"structured_outputs": {"json": BENCH_SCHEMA}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"structured_outputs": {"regex": BENCH_REGEX}},
    "choice": {"structured_outputs": {"choice": list(BENCH_CHOICES)}},
}


# ---------------------------------------------------------------- types


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a dataset: a completion prompt (ids or text) or chat messages."""

    prompt: list[int] | str | None
    messages: list[dict[str, str]] | None
    prompt_len: int  # tokens by the benchmark's tokenizer (the server's usage may differ)
    output_len: int
    conversation: int | None = None  # turns of one conversation run in order
    tag: str = ""  # groups requests for their own metrics (e.g. "short" and "long")
    structured: str | None = None  # a STRUCTURED_FIELDS kind constraining the output


@dataclass(frozen=True, slots=True)
class ServerCaps:
    """What a server accepts, found by `probe_server`."""

    token_ids: bool
    eos_mode: str
    model: str | None


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """How to send the requests; independent of the dataset."""

    base_url: str
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    goodput: dict[str, float] = field(default_factory=dict)  # SLO name -> milliseconds
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    request_timeout: float = 600.0
    num_warmups: int = 1
    api_key: str | None = None
    model: str | None = None  # None: the server's own (or leave the field out)
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.request_rate <= 0:
            raise ValueError("request_rate must be positive (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        unknown = set(self.goodput) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"unknown goodput metrics {sorted(unknown)}; use {SLO_METRICS}")


@dataclass(slots=True)
class RequestResult:
    """What one streamed request measured; times in seconds."""

    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    error: str = ""
    tag: str = ""
    conversation: int | None = None
    expected_prompt_len: int = 0
    expected_output_len: int = 0
    has_usage: bool = False  # lengths are the server's usage counts (else our own)
    structured: str | None = None
    text: str = ""  # the output, kept for constrained requests only

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------- datasets


class TokenPool:
    """Token ids that decode to plain printable text, and text of an exact token count.

    Random ids from the whole vocabulary would decode to broken UTF-8 and special tokens that
    re-tokenize to other lengths; this pool keeps text prompts honest.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self.ids = [i for i in range(len(tokenizer)) if i not in special and self._plain(i)]
        if len(self.ids) < 16:
            raise ValueError("the tokenizer has too few plain-text tokens to build prompts")

    def _plain(self, token_id: int) -> bool:
        text = self.tokenizer.decode([token_id])
        return bool(text.strip()) and text.isascii() and text.isprintable()

    def token_ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.ids) for _ in range(n)]

    def text(self, rng: random.Random, n: int) -> str:
        """Text that this tokenizer encodes to n tokens (to within a token or two)."""
        return self.fit_text(self.token_ids(rng, n), n, rng)

    def fit_text(self, ids: list[int], n: int, rng: random.Random) -> str:
        """ids decoded, then trimmed or padded until the text re-encodes to n tokens: tokens
        decoded side by side may merge into fewer when encoded again."""
        for _ in range(4):
            text = self.tokenizer.decode(ids)
            ids = self.encode(text)
            if len(ids) == n:
                return text
            ids = ids[:n] + self.token_ids(rng, max(0, n - len(ids)))
        return self.tokenizer.decode(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, int(mean * (1 + range_ratio))))


def random_requests(
    pool: TokenPool,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tag: str = "",
) -> list[BenchRequest]:
    """Completions with random plain-token prompts; `prompt` holds ids (text is made later
    for servers that only take text, see `as_text`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = sample_len(rng, input_len, range_ratio)
        n_out = sample_len(rng, output_len, range_ratio)
        out.append(BenchRequest(pool.token_ids(rng, n_in), None, n_in, n_out, tag=tag))
    return out


def as_text(pool: TokenPool, requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """The same requests with id prompts turned into text of the same token count, for
    servers that take only text."""
    out = []
    for r in requests:
        if isinstance(r.prompt, list):
            rng = random.Random(r.prompt_len * 7919 + sum(r.prompt[:8]))
            text = pool.fit_text(r.prompt, r.prompt_len, rng)
            n = len(pool.encode(text))
            r = replace(r, prompt=text, prompt_len=n)
        out.append(r)
    return out


def multiturn_requests(
    pool: TokenPool,
    num_conversations: int,
    turns: int,
    input_len: int,
    output_len: int,
    system_len: int = 256,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Chat requests: conversation c's turn t carries the shared system prompt and turns
    0..t-1 (synthetic assistant answers of about output_len tokens) before its new message.

    Requests come turn-major (every conversation's first turn, then every second turn, ...);
    `run_benchmark` still holds each turn until its conversation's previous turn has finished.
    """
    rng = random.Random(seed)
    system = {"role": "system", "content": pool.text(rng, system_len)}
    histories: list[list[dict[str, str]]] = [[system] for _ in range(num_conversations)]
    out = []
    for _ in range(turns):
        for c, history in enumerate(histories):
            user = {
                "role": "user",
                "content": pool.text(rng, sample_len(rng, input_len, range_ratio)),
            }
            n_out = sample_len(rng, output_len, range_ratio)
            messages = [*history, user]
            out.append(BenchRequest(None, messages, _chat_len(pool, messages), n_out, c))
            answer = pool.text(rng, n_out)
            history.extend([user, {"role": "assistant", "content": answer}])
    return out


def _chat_len(pool: TokenPool, messages: list[dict[str, str]]) -> int:
    tok = pool.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    return sum(len(pool.encode(m["content"])) for m in messages)


def with_structured(
    requests: Sequence[BenchRequest], kind: str, ratio: float = 1.0, seed: int = 0
) -> list[BenchRequest]:
    """The requests with a share `ratio` (drawn with `seed`) constrained by `kind` and tagged
    "structured", the others tagged "free"."""
    if kind not in STRUCTURED_FIELDS:
        raise ValueError(f"unknown structured output {kind!r}; use {sorted(STRUCTURED_FIELDS)}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError("structured output ratio must be within [0, 1]")
    rng = random.Random(seed + 1)
    out = []
    for r in requests:
        on = rng.random() < ratio
        out.append(replace(r, structured=kind if on else None, tag="structured" if on else "free"))
    return out


def structured_valid(kind: str, text: str) -> bool:
    """Whether an output is what the constraint asks for (the whole text)."""
    if kind == "regex":
        return re.fullmatch(BENCH_REGEX, text) is not None
    if kind == "choice":
        return text in BENCH_CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    return (
        isinstance(value, dict)
        and set(value) == set(BENCH_SCHEMA["required"])
        and isinstance(value["name"], str)
        and isinstance(value["age"], int)
        and value["role"] in BENCH_SCHEMA["properties"]["role"]["enum"]
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
    )


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from start) of n requests arriving as a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- one request


def request_body(
    req: BenchRequest, caps: ServerCaps, temperature: float, stream: bool = True
) -> dict[str, Any]:
    """The JSON body: only fields the server accepts (transformers serve 422s on others)."""
    body: dict[str, Any] = {"max_tokens": req.output_len, "temperature": temperature}
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    if caps.model is not None:
        body["model"] = caps.model
    if req.structured is not None:
        body.update(STRUCTURED_FIELDS[req.structured])
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if caps.eos_mode == "ignore_eos":
        body["ignore_eos"] = True
    elif caps.eos_mode == "generation_config":
        # Replaces the model's generation config: greedy unless sampling, and EOS id -1 (none).
        config = {"eos_token_id": -1, "do_sample": temperature > 0}
        body["generation_config"] = json.dumps(config)
    return body


def _endpoint(req: BenchRequest) -> str:
    return "/v1/chat/completions" if req.messages is not None else "/v1/completions"


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta else (choice.get("text") or "")
    return text


async def stream_request(
    client: httpx.AsyncClient, req: BenchRequest, caps: ServerCaps, temperature: float
) -> RequestResult:
    """Send one streaming request and time its chunks; errors come back as a failed result."""
    res = _empty_result(req)
    body = request_body(req, caps, temperature)
    res.start = time.perf_counter()
    try:
        async with client.stream("POST", _endpoint(req), json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return res
            await _read_stream(resp, res)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _empty_result(req: BenchRequest) -> RequestResult:
    return RequestResult(
        tag=req.tag,
        conversation=req.conversation,
        expected_prompt_len=req.prompt_len,
        expected_output_len=req.output_len,
        structured=req.structured,
    )


async def _read_stream(resp: httpx.Response, res: RequestResult) -> None:
    last = res.start
    chunks, usage, done = 0, None, False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
            return
        now = time.perf_counter()
        if text := _chunk_text(chunk):
            if res.structured is not None:
                res.text += text
            if chunks == 0:
                res.ttft = now - res.start
            else:
                res.itl.append(now - last)
            chunks, last = chunks + 1, now
        usage = chunk.get("usage") or usage
    res.e2e = time.perf_counter() - res.start
    _finish(res, usage, chunks, done)


def _finish(res: RequestResult, usage: dict | None, chunks: int, done: bool) -> None:
    if chunks == 0:
        res.error = "no text came back"
        return
    if not done and not usage:
        res.error = "stream ended without [DONE] or usage"
        return
    res.success = True
    res.has_usage = bool(usage)
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens", res.expected_prompt_len)
        res.output_tokens = usage.get("completion_tokens", chunks)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens") or 0
    else:  # the best we know; counted in the result as usage_missing
        res.prompt_tokens, res.output_tokens = res.expected_prompt_len, chunks


# ---------------------------------------------------------------- probing


async def probe_server(
    client: httpx.AsyncClient,
    pool: TokenPool,
    model: str | None,
    chat: bool,
    structured: frozenset[str] = frozenset(),
) -> ServerCaps:
    """Find what the server accepts with tiny non-streaming requests (which also warm it up);
    RuntimeError when it refuses a structured-output kind the run needs."""
    model = model or await _served_model(client)
    rng = random.Random(12345)
    ids = pool.token_ids(rng, 8)
    messages = [{"role": "user", "content": pool.text(rng, 8)}]
    prompt = BenchRequest(ids, None, 8, 2) if not chat else BenchRequest(None, messages, 8, 2)
    token_ids = False
    if not chat:
        token_ids = await _accepted(client, prompt, ServerCaps(True, "none", model))
        if not token_ids:
            prompt = as_text(pool, [prompt])[0]
    for mode in EOS_MODES:
        if await _accepted(client, prompt, ServerCaps(token_ids, mode, model)):
            caps = ServerCaps(token_ids, mode, model)
            for kind in sorted(structured):
                if not await _accepted(client, replace(prompt, structured=kind), caps):
                    fields = ", ".join(STRUCTURED_FIELDS[kind])
                    raise RuntimeError(f"the server at {client.base_url} refuses {fields}")
            return caps
    raise RuntimeError(f"the server at {client.base_url} answered no probe request")


async def _accepted(client: httpx.AsyncClient, req: BenchRequest, caps: ServerCaps) -> bool:
    """Whether the server answers 200 (4xx: it refuses these fields; 5xx: RuntimeError)."""
    body = request_body(req, caps, 0.0, stream=False)
    for attempt in range(PROBE_ATTEMPTS):
        try:
            resp = await client.post(_endpoint(req), json=body)
        except httpx.TransportError:
            # A server that closed a kept-alive connection after an error (transformers serve
            # does after a failed /v1/models) breaks one request; a fresh connection is fine.
            continue
        if resp.status_code != 503:
            break
        await asyncio.sleep(2.0 * (attempt + 1))  # "retry later": a node still starting
    else:
        raise RuntimeError(f"probe failed {PROBE_ATTEMPTS} times at {client.base_url}")
    if resp.status_code >= 500:
        raise RuntimeError(f"probe failed: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.status_code == 200


async def _served_model(client: httpx.AsyncClient) -> str | None:
    """The first model /v1/models lists; None (leave `model` out) when it cannot say."""
    try:
        resp = await client.get("/v1/models")
        return resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


# ---------------------------------------------------------------- the run


async def _warmup(client: httpx.AsyncClient, pool: TokenPool, caps: ServerCaps, n: int) -> None:
    """Short untimed requests with prompts of their own (no prefix-cache help for the run)."""
    rng = random.Random(999)
    for _ in range(n):
        prompt: list[int] | str = pool.token_ids(rng, 16)
        if not caps.token_ids:
            prompt = pool.tokenizer.decode(prompt)
        res = await stream_request(client, BenchRequest(prompt, None, 16, 4), caps, 0.0)
        if not res.success:
            raise RuntimeError(f"warm-up request failed: {res.error}")


def _progress(total: int, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=disable, desc="requests", unit="req", file=sys.stderr)


async def _send_all(
    client: httpx.AsyncClient,
    config: BenchConfig,
    caps: ServerCaps,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(config.max_concurrency or len(requests))
    previous: dict[int, asyncio.Event] = {}  # conversation -> its latest turn's done event
    bar = _progress(len(requests), config.disable_tqdm)
    start = time.perf_counter()

    async def one(
        req: BenchRequest, at: float, after: asyncio.Event | None, done: asyncio.Event
    ) -> RequestResult:
        try:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if after is not None:
                await after.wait()
            async with sem:
                return await _bounded(client, req, caps, config)
        finally:
            done.set()
            bar.update(1)

    tasks = []
    for req, at in zip(requests, arrivals):
        done = asyncio.Event()
        after = previous.get(req.conversation) if req.conversation is not None else None
        if req.conversation is not None:
            previous[req.conversation] = done
        tasks.append(asyncio.create_task(one(req, at, after, done)))
    results = await asyncio.gather(*tasks)
    bar.close()
    duration = time.perf_counter() - start
    for r in results:
        r.start -= start  # seconds since the run began
    return list(results), duration


async def _bounded(
    client: httpx.AsyncClient, req: BenchRequest, caps: ServerCaps, config: BenchConfig
) -> RequestResult:
    sent = time.perf_counter()
    try:
        return await asyncio.wait_for(
            stream_request(client, req, caps, config.temperature), config.request_timeout
        )
    except asyncio.TimeoutError:
        res = _empty_result(req)
        res.start = sent
        res.error = f"timed out after {config.request_timeout}s"
        return res


def make_client(config: BenchConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"), headers=headers, timeout=timeout, limits=limits
    )


async def run_benchmark_async(
    config: BenchConfig,
    requests: Sequence[BenchRequest],
    pool: TokenPool,
    arrivals: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Probe, warm up, send every request (Poisson arrivals unless `arrivals` gives the send
    times) and summarize. Text prompts replace id prompts when the server takes no ids."""
    if not requests:
        raise ValueError("no requests to send")
    if arrivals is None:
        arrivals = poisson_arrivals(len(requests), config.request_rate, config.seed)
    if len(arrivals) != len(requests):
        raise ValueError("one arrival time per request")
    async with make_client(config) as client:
        chat = requests[0].messages is not None
        kinds = frozenset(r.structured for r in requests if r.structured is not None)
        caps = await probe_server(client, pool, config.model, chat, kinds)
        if not caps.token_ids:
            requests = as_text(pool, requests)
        await _warmup(client, pool, caps, config.num_warmups)
        results, duration = await _send_all(client, config, caps, requests, arrivals)
    summary = summarize(results, duration, config)
    summary["server"] = asdict(caps)
    return summary


def run_benchmark(
    config: BenchConfig,
    requests: Sequence[BenchRequest],
    pool: TokenPool,
    arrivals: Sequence[float] | None = None,
) -> dict[str, Any]:
    """`run_benchmark_async` on a fresh event loop: the result dict (see `summarize`)."""
    return asyncio.run(run_benchmark_async(config, requests, pool, arrivals))


# ---------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(name: str, values_s: Sequence[float], pcts: Sequence[float]) -> dict[str, float]:
    """mean/median/std and the given percentiles of values (seconds), in milliseconds."""
    ms = [v * 1000 for v in values_s]
    n = len(ms)
    mean = sum(ms) / n if n else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / n) if n else math.nan
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(ms, 50), f"std_{name}_ms": std}
    for q in pcts:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def _meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(values[k] * 1000 <= limit for k, limit in slos.items())


def summarize(
    results: Sequence[RequestResult], duration: float, config: BenchConfig
) -> dict[str, Any]:
    """vLLM-style summary of a run, plus each request's numbers (for plots) and, when
    requests carry tags, the same metrics per tag under `by_tag`."""
    out = _metrics(results, duration, config)
    out.update(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        base_url=config.base_url,
        request_rate=config.request_rate if math.isfinite(config.request_rate) else "inf",
        max_concurrency=config.max_concurrency,
        seed=config.seed,
        goodput_slos_ms=dict(config.goodput),
        requests=[_per_request(r) for r in results],
    )
    tags = sorted({r.tag for r in results if r.tag})
    if tags:
        out["by_tag"] = {
            t: _metrics([r for r in results if r.tag == t], duration, config) for t in tags
        }
    return out


def _metrics(
    results: Sequence[RequestResult], duration: float, config: BenchConfig
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = [r for r in ok if _meets_slos(r, config.goodput)] if config.goodput else []
    out: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "input_len_mismatches": sum(r.prompt_tokens != r.expected_prompt_len for r in ok),
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_len for r in ok),
        "usage_missing": sum(not r.has_usage for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "request_goodput": len(good) / duration if config.goodput else None,
    }
    constrained = [r for r in ok if r.structured is not None]
    if constrained:
        valid = sum(structured_valid(r.structured, r.text) for r in constrained)
        out.update(structured_valid=valid, structured_invalid=len(constrained) - valid)
    pcts = config.percentiles
    out.update(distribution("ttft", [r.ttft for r in ok], pcts))
    out.update(distribution("tpot", [t for r in ok if (t := r.tpot) is not None], pcts))
    out.update(distribution("itl", [x for r in ok for x in r.itl], pcts))
    out.update(distribution("e2el", [r.e2e for r in ok], pcts))
    return out


def _per_request(r: RequestResult) -> dict[str, Any]:
    return {
        "success": r.success,
        "tag": r.tag,
        "conversation": r.conversation,
        "start_s": r.start,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "cached_tokens": r.cached_tokens,
        "ttft_s": r.ttft,
        "e2e_s": r.e2e,
        "itl_s": [round(x, 6) for x in r.itl],
        "error": r.error,
        "structured": r.structured,
        "text": r.text if r.structured is not None else None,
    }


# ---------------------------------------------------------------- text report


def format_report(result: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The result as the aligned text block a terminal shows."""
    width = 56
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>16}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Request rate (req/s):", result["request_rate"])
    row("Max concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration_s"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name, label in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f" {label} ".center(width, "-"))
        for key, value in result.items():
            if key.endswith(f"_{name}_ms") and not key.startswith("std"):
                stat = key.split("_")[0].capitalize()
                row(f"{stat} {name.upper()} (ms):", value)
    if "structured_valid" in result:
        row("Structured outputs valid:", result["structured_valid"])
        row("Structured outputs invalid:", result["structured_invalid"])
    if result["input_len_mismatches"] or result["output_len_mismatches"]:
        lines.append(
            f"note: {result['input_len_mismatches']} prompts and {result['output_len_mismatches']}"
            " outputs differ in length from what was asked (usage counts are reported)"
        )
    lines.append("=" * width)
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; ValueError on bad input."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad --goodput item {item!r}: want NAME:MS, NAME in {SLO_METRICS}")
        slos[name] = float(value)
    return slos


def build_parser() -> argparse.ArgumentParser:
    p = parser("pdserve bench serve", __doc__.split("\n\n")[0])
    server = p.add_argument_group("server")
    server.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the OpenAI-compatible server"
    )
    server.add_argument("--api-key", default=None, help="sent as a Bearer token")
    server.add_argument(
        "--model", default=None, help="model name to send (default: the first of /v1/models)"
    )
    server.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="tokenizer directory (the model's): builds prompts and counts their tokens",
    )
    data = p.add_argument_group("dataset")
    data.add_argument(
        "--dataset",
        default="random",
        choices=["random", "multiturn"],
        help="random: /v1/completions; multiturn: /v1/chat/completions conversations",
    )
    data.add_argument("--num-prompts", type=int, default=32, help="random: requests")
    data.add_argument("--input-len", type=int, default=256, help="tokens per prompt, on average")
    data.add_argument("--output-len", type=int, default=64, help="tokens per output, on average")
    data.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in len * [1 - r, 1 + r]",
    )
    data.add_argument("--num-conversations", type=int, default=8, help="multiturn: conversations")
    data.add_argument("--turns", type=int, default=3, help="multiturn: turns per conversation")
    data.add_argument(
        "--system-prompt-len",
        type=int,
        default=256,
        help="multiturn: tokens of the system prompt all conversations share",
    )
    data.add_argument(
        "--structured-output",
        default=None,
        choices=sorted(STRUCTURED_FIELDS),
        help="constrain requests with this structured output (default: none)",
    )
    data.add_argument(
        "--structured-output-ratio",
        type=float,
        default=1.0,
        help="share of the requests constrained; the rest run free in the same run",
    )
    data.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts, arrivals")
    data.add_argument(
        "--quick", action="store_true", help="a few short requests, no warm-up (for tests)"
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    load.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take"
    )
    load.add_argument(
        "--num-warmups", type=int, default=1, help="untimed requests sent before the run"
    )
    metrics = p.add_argument_group("metrics")
    metrics.add_argument(
        "--goodput",
        nargs="*",
        default=None,
        metavar="NAME:MS",
        help=f"SLOs in milliseconds, NAME in {','.join(SLO_METRICS)}, e.g. ttft:500 tpot:50 "
        "(default: no goodput)",
    )
    metrics.add_argument(
        "--percentiles", default="50,90,99", help="percentiles reported, a comma list"
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--result-file", default=None, metavar="FILE", help="write the result as JSON here"
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    try:
        return BenchConfig(
            base_url=args.base_url,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            temperature=args.temperature,
            goodput=parse_goodput(args.goodput),
            percentiles=tuple(float(q) for q in args.percentiles.split(",") if q),
            request_timeout=args.request_timeout,
            num_warmups=args.num_warmups,
            api_key=args.api_key,
            model=args.model,
            disable_tqdm=args.disable_tqdm,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def dataset_from_args(args: argparse.Namespace, pool: TokenPool) -> list[BenchRequest]:
    requests = _dataset(args, pool)
    if args.structured_output is None:
        return requests
    try:
        return with_structured(
            requests, args.structured_output, args.structured_output_ratio, args.seed
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def _dataset(args: argparse.Namespace, pool: TokenPool) -> list[BenchRequest]:
    if args.dataset == "multiturn":
        return multiturn_requests(
            pool,
            args.num_conversations,
            args.turns,
            args.input_len,
            args.output_len,
            args.system_prompt_len,
            args.range_ratio,
            args.seed,
        )
    return random_requests(
        pool, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
    )


def load_pool(tokenizer_dir: str) -> TokenPool:
    from transformers import AutoTokenizer

    return TokenPool(AutoTokenizer.from_pretrained(tokenizer_dir))


QUICK = {
    "num_prompts": 6,
    "input_len": 32,
    "output_len": 6,
    "num_conversations": 2,
    "turns": 2,
    "system_prompt_len": 32,
    "num_warmups": 0,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    config = config_from_args(args)
    pool = load_pool(args.tokenizer)
    requests = dataset_from_args(args, pool)
    result = run_benchmark(config, requests, pool)
    cli = sys.argv[1:] if argv is None else list(argv)
    result.update(dataset=args.dataset, tokenizer=args.tokenizer, argv=cli)
    print(format_report(result))
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

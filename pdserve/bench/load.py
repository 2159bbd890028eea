"""The load generator of the HTTP benchmarks: workloads, one SSE reader, one result record,
open and closed loops, and the metrics of a run."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SLO_METRICS = ("ttft", "tpot", "e2el")  # goodput SLO names, as vLLM's --goodput takes them
EOS_MODES = ("ignore_eos", "generation_config", "none")  # in the order the probe tries them
PROBE_ATTEMPTS = 30  # 2 s apart: a loaded machine can take a minute to register nodes

# Structured-output kinds: the request fields each adds. The schema's strings and list are
# bounded, so a conforming object ends well within 100 tokens of a small model's vocabulary.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["name", "age", "role", "tags"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                            "maxItems": 3}},
}  # fmt: skip
BENCH_REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
BENCH_CHOICES = ("positive", "negative", "neutral")
STRUCTURED_FIELDS: dict[str, dict[str, Any]] = {
    "json": {"structured_outputs": {"json": BENCH_SCHEMA}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"structured_outputs": {"regex": BENCH_REGEX}},
    "choice": {"structured_outputs": {"choice": list(BENCH_CHOICES)}},
}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: a completion prompt (ids or text), or the chat messages a conversation's
    turn adds (the runner puts the conversation's earlier turns, answers included, before)."""

    prompt: list[int] | str | None
    messages: list[dict[str, str]] | None
    prompt_len: int | None  # tokens by our tokenizer; None: unknown before sending (a turn)
    output_len: int
    conversation: int | None = None
    tag: str = ""  # groups requests for their own metrics (e.g. "short" and "long")
    structured: str | None = None  # a STRUCTURED_FIELDS kind constraining the output
    exact: bool = False  # min_tokens = max_tokens: no EOS inside the answer


@dataclass(frozen=True, slots=True)
class ServerCaps:
    """What a server accepts, found by `probe_server`."""

    token_ids: bool
    eos_mode: str
    model: str | None


@dataclass(slots=True)
class RequestResult:
    """What one streamed request measured; times in seconds, `start` from the run's start
    once a run is over."""

    success: bool = False
    status: int = 0
    start: float = 0.0
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    e2e: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    chunks: int = 0  # SSE chunks that carried text
    done: bool = False  # [DONE] seen
    has_usage: bool = False  # lengths are the server's usage counts (else our own)
    text: str = ""  # kept only when asked for
    error: str = ""
    last: float = 0.0  # when the latest text chunk came
    tag: str = ""
    conversation: int | None = None
    expected_prompt_len: int | None = None
    expected_output_len: int = 0
    structured: str | None = None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens - 1
        return (self.e2e - self.ttft) / n if n > 0 else None


def take_event(res: RequestResult, data: str, now: float, keep_text: bool) -> bool:
    """Apply one SSE `data:` payload to the result; True when the stream ends ([DONE], error)."""
    if data == "[DONE]":
        res.done = True
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        res.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
        return True
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta else (choice.get("text") or "")
        res.finish_reason = choice.get("finish_reason") or res.finish_reason
    if text:
        if res.chunks:
            res.itl.append(now - res.last)
        else:
            res.ttft = now - res.start
        res.chunks, res.last = res.chunks + 1, now
        res.text += text if keep_text else ""
    if usage := chunk.get("usage"):
        res.has_usage = True
        res.prompt_tokens = usage.get("prompt_tokens", 0)
        res.output_tokens = usage.get("completion_tokens", 0)
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return False


def finish(res: RequestResult, now: float) -> RequestResult:
    """Close a read stream: its latency, and whether it counts as answered."""
    res.e2e = now - res.start
    if res.error:
        return res
    if res.chunks == 0:
        res.error = "no text came back"
    elif not res.done and not res.has_usage:
        res.error = "stream ended without [DONE] or usage"
    else:
        res.success = True
        if not res.has_usage:  # the best we know; counted as usage_missing
            res.output_tokens = res.chunks
    return res


async def stream_one(client: httpx.AsyncClient, base_url: str, body: dict, *, keep_text: bool,
                     timeout_s: float) -> RequestResult:  # fmt: skip
    """POST one streaming request (chat when `body` has messages) and read it whole; errors,
    timeouts included, come back in the result."""
    res = RequestResult(start=time.perf_counter())
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    url = base_url.rstrip("/") + path
    try:
        await asyncio.wait_for(_read(client, url, body, res, keep_text), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout_s}s"
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return finish(res, time.perf_counter())


async def _read(client: httpx.AsyncClient, url: str, body: dict, res: RequestResult, keep: bool):
    async with client.stream("POST", url, json=body) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread())[:300].decode(errors="replace")
            res.error = f"HTTP {resp.status_code}: {text}"
            return
        async for line in resp.aiter_lines():
            data = line[5:].strip()
            if line.startswith("data:") and take_event(res, data, time.perf_counter(), keep):
                return


def make_client(base_url: str = "", api_key: str | None = None) -> httpx.AsyncClient:
    """A client with no connection limit (the runner bounds what is in flight); per-request
    timeouts come from `stream_one`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                             timeout=httpx.Timeout(None, connect=30.0))  # fmt: skip


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


def load_pool(tokenizer_dir: str) -> TokenPool:
    from transformers import AutoTokenizer

    return TokenPool(AutoTokenizer.from_pretrained(tokenizer_dir))


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    return rng.randint(low, max(low, int(mean * (1 + range_ratio))))


def random_requests(
    pool: TokenPool, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
    seed: int = 0, tag: str = "",
) -> list[BenchRequest]:  # fmt: skip
    """Completions with random plain-token prompts; `prompt` holds ids (text is made later
    for servers that only take text, see `as_text`)."""
    rng, out = random.Random(seed), []
    for _ in range(num):
        n_in, n_out = (sample_len(rng, n, range_ratio) for n in (input_len, output_len))
        out.append(BenchRequest(pool.token_ids(rng, n_in), None, n_in, n_out, tag=tag))
    return out


def as_text(pool: TokenPool, requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """The same requests with id prompts turned into text of the same token count, for
    servers that take only text."""
    out = []
    for r in requests:
        if isinstance(r.prompt, list):
            rng = random.Random(len(r.prompt) * 7919 + sum(r.prompt[:8]))
            text = pool.fit_text(r.prompt, len(r.prompt), rng)
            r = replace(r, prompt=text, prompt_len=len(pool.encode(text)))
        out.append(r)
    return out


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Conversations: user messages of seeded lengths (a long first one, shorter ones after),
    answers generated by the server and carried as text into the next turn."""

    conversations: int = 4
    turns: int = 6
    first_len: int = 256  # each conversation's first user message, tokens
    message_len: int = 48  # later user messages, on average
    range_ratio: float = 0.5  # later messages' lengths uniform in message_len * [1 -+ r]
    answer_len: int = 48
    answer_range: float = 0.0  # answers' lengths uniform in answer_len * [1 -+ r]
    system_len: int = 0  # tokens of a system prompt every conversation starts with
    exact: bool = True  # min_tokens = max_tokens: an answer holds no EOS
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.conversations, self.turns, self.first_len, self.answer_len) < 1:
            raise ValueError("conversations, turns, first and answer lengths must be >= 1")


def chat_turns(pool: TokenPool, w: ChatWorkload) -> list[list[BenchRequest]]:
    """[turn][conversation] -> the request that turn adds, the same for every server."""
    rng, answers = random.Random(w.seed), random.Random(w.seed + 1)
    system = pool.text(random.Random(w.seed - 1), w.system_len) if w.system_len else None
    users = []
    for _ in range(w.conversations):
        rest = [sample_len(rng, w.message_len, w.range_ratio) for _ in range(w.turns - 1)]
        users.append([pool.text(rng, n) for n in [w.first_len, *rest]])
    out = []
    for t in range(w.turns):
        turn = []
        for c, messages in enumerate(users):
            new = [{"role": "user", "content": messages[t]}]
            if t == 0 and system is not None:
                new.insert(0, {"role": "system", "content": system})
            n_out = sample_len(answers, w.answer_len, w.answer_range)
            turn.append(BenchRequest(None, new, None, n_out, conversation=c, exact=w.exact))
        out.append(turn)
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
    if kind == "json_object" or not isinstance(value, dict):
        return isinstance(value, dict)
    kinds = {"name": str, "age": int, "tags": list}
    return (
        set(value) == set(BENCH_SCHEMA["required"])
        and all(isinstance(value[k], t) for k, t in kinds.items())
        and value["role"] in BENCH_SCHEMA["properties"]["role"]["enum"]
        and len(value["tags"]) <= 3
    )


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from start) of n requests arriving as a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_body(req: BenchRequest, caps: ServerCaps, temperature: float, history: Sequence = (),
                 stream=True) -> dict[str, Any]:  # fmt: skip
    """The JSON body: only fields the server accepts (transformers serve 422s on others)."""
    body: dict[str, Any] = {"max_tokens": req.output_len, "temperature": temperature}
    if req.messages is not None:
        body["messages"] = [*history, *req.messages]
    else:
        body["prompt"] = req.prompt
    if caps.model is not None:
        body["model"] = caps.model
    body.update(STRUCTURED_FIELDS[req.structured] if req.structured is not None else {})
    if req.exact or caps.eos_mode == "ignore_eos":  # a server ignoring ignore_eos: llama.cpp
        body["min_tokens"] = req.output_len
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if caps.eos_mode == "ignore_eos":
        body["ignore_eos"] = True
    elif caps.eos_mode == "generation_config":
        # Replaces the model's generation config: greedy unless sampling, and EOS id -1 (none).
        body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": temperature > 0})
    return body


@dataclass(slots=True)
class Sender:
    """Sends BenchRequests to one server in the form its probe found it takes, and keeps
    each conversation's messages so far (a turn that failed adds nothing)."""

    client: httpx.AsyncClient
    base_url: str
    caps: ServerCaps
    temperature: float = 0.0
    timeout_s: float = 600.0
    histories: dict[int, list[dict[str, str]]] = field(default_factory=dict)

    async def send(self, req: BenchRequest) -> RequestResult:
        chat = req.conversation is not None and req.messages is not None
        history = self.histories.setdefault(req.conversation, []) if chat else []  # type: ignore[arg-type]
        body = request_body(req, self.caps, self.temperature, history)
        keep = chat or req.structured is not None
        res = await stream_one(self.client, self.base_url, body, keep_text=keep,
                               timeout_s=self.timeout_s)  # fmt: skip
        res.tag, res.conversation, res.structured = req.tag, req.conversation, req.structured
        res.expected_prompt_len, res.expected_output_len = req.prompt_len, req.output_len
        if res.success and not res.has_usage:
            res.prompt_tokens = req.prompt_len or 0
        if chat and res.success:
            history += [*req.messages, {"role": "assistant", "content": res.text}]  # type: ignore[misc]
        return res


async def send_all(sender: Sender, requests: Sequence[BenchRequest], arrivals: Sequence[float],
                   max_concurrency: int | None = None, progress: bool = False
) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Open loop: each request at its arrival time (s from now), at most max_concurrency in
    flight; a conversation's turn waits until its previous turn has answered. Returns the
    results (starts made relative to the run's start) and the run's duration."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(max_concurrency or len(requests))
    previous: dict[int, asyncio.Event] = {}  # conversation -> its latest turn's done event
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)
    start = time.perf_counter()

    async def one(req: BenchRequest, at: float, after: Any, done: Any) -> RequestResult:
        try:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if after is not None:
                await after.wait()
            async with sem:
                return await sender.send(req)
        finally:
            if done is not None:
                done.set()
            bar.update(1)

    tasks = []
    for req, at in zip(requests, arrivals):
        after = done = None
        if req.conversation is not None:
            after = previous.get(req.conversation)
            done = previous[req.conversation] = asyncio.Event()
        tasks.append(asyncio.create_task(one(req, at, after, done)))
    results = await asyncio.gather(*tasks)
    bar.close()
    for r in results:
        r.start -= start
    return list(results), time.perf_counter() - start


async def closed_loop(send: Callable[[int, int], Awaitable[RequestResult]], *, concurrency: int,
                      duration_s: float,
                      on_result: Callable[[int, RequestResult], None] = lambda i, r: None
) -> int:  # fmt: skip
    """Closed loop: `concurrency` workers, each sending its next request as soon as its last
    one ended, until duration_s has passed; `send(worker, i)` sends request i and
    `on_result(i, result)` takes each result. Returns how many requests were sent."""
    deadline = time.monotonic() + duration_s
    counter = itertools.count()

    async def worker(w: int) -> None:
        while time.monotonic() < deadline:
            i = next(counter)
            on_result(i, await send(w, i))

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return next(counter)


async def probe_server(sender: Sender, pool: TokenPool, chat: bool,
                       structured: frozenset[str] = frozenset()) -> ServerCaps:  # fmt: skip
    """Find what the server accepts with tiny non-streaming requests (which also warm it up);
    RuntimeError when it refuses a structured-output kind the run needs."""
    model = sender.caps.model or await _served_model(sender.client)
    rng = random.Random(12345)
    ids = pool.token_ids(rng, 8)
    messages = [{"role": "user", "content": pool.text(rng, 8)}]
    prompt = BenchRequest(None, messages, 8, 2) if chat else BenchRequest(ids, None, 8, 2)
    token_ids = not chat and await _accepted(sender, prompt, ServerCaps(True, "none", model))
    if not chat and not token_ids:
        prompt = as_text(pool, [prompt])[0]
    for mode in EOS_MODES:
        caps = ServerCaps(token_ids, mode, model)
        if await _accepted(sender, prompt, caps):
            for kind in sorted(structured):
                if not await _accepted(sender, replace(prompt, structured=kind), caps):
                    fields = ", ".join(STRUCTURED_FIELDS[kind])
                    raise RuntimeError(f"the server at {sender.base_url} refuses {fields}")
            return caps
    raise RuntimeError(f"the server at {sender.base_url} answered no probe request")


async def _accepted(sender: Sender, req: BenchRequest, caps: ServerCaps) -> bool:
    """Whether the server answers 200 (4xx or a validation error: it refuses these fields;
    other 5xx: RuntimeError)."""
    body = request_body(req, caps, 0.0, stream=False)
    path = "/v1/chat/completions" if req.messages is not None else "/v1/completions"
    for _ in range(PROBE_ATTEMPTS):
        try:
            resp = await sender.client.post(path, json=body, timeout=sender.timeout_s)
        except httpx.TransportError:
            # A server that closed a kept-alive connection after an error (transformers serve
            # does after a failed /v1/models) breaks one request; a fresh connection is fine.
            continue
        if resp.status_code != 503:
            break
        await asyncio.sleep(2.0)  # "retry later": a node still starting
    else:
        raise RuntimeError(f"probe failed {PROBE_ATTEMPTS} times at {sender.base_url}")
    if resp.status_code >= 500 and "validation error" not in resp.text:  # llama.cpp: 500s them
        raise RuntimeError(f"probe failed: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.status_code == 200


async def _served_model(client: httpx.AsyncClient) -> str | None:
    """The first model /v1/models lists; None (leave `model` out) when it cannot say."""
    try:
        resp = await client.get("/v1/models", timeout=30.0)
        return resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


async def warm_up(sender: Sender, pool: TokenPool, n: int, chat: bool = False) -> None:
    """Short untimed requests with prompts of their own (no prefix-cache help for the run)."""
    rng = random.Random(999)
    for _ in range(n):
        if chat:
            user = {"role": "user", "content": pool.text(rng, 24)}
            req = BenchRequest(None, [user], None, 4, exact=True)
        else:
            ids = pool.token_ids(rng, 16)
            prompt = ids if sender.caps.token_ids else pool.tokenizer.decode(ids)
            req = BenchRequest(prompt, None, 16, 4)
        res = await sender.send(req)
        if not res.success:
            raise RuntimeError(f"warm-up request failed: {res.error}")


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
        if unknown := set(self.goodput) - set(SLO_METRICS):
            raise ValueError(f"unknown goodput metrics {sorted(unknown)}; use {SLO_METRICS}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> BenchConfig:
        """The fields a benchmark's flags name (same names), then `given`."""
        names = {f.name for f in fields(cls)} - set(given)
        return cls(**{k: v for k, v in vars(args).items() if k in names}, **given)


def run_benchmark(config: BenchConfig, requests: Sequence[BenchRequest], pool: TokenPool,
                  arrivals: Sequence[float] | None = None) -> dict[str, Any]:  # fmt: skip
    """Probe, warm up, send every request (Poisson arrivals unless `arrivals` gives the send
    times) and summarize (see `summarize`), on a fresh event loop. Text prompts replace id
    prompts when the server takes no ids."""
    if not requests:
        raise ValueError("no requests to send")
    if arrivals is None:
        arrivals = poisson_arrivals(len(requests), config.request_rate, config.seed)
    if len(arrivals) != len(requests):
        raise ValueError("one arrival time per request")
    chat = requests[0].messages is not None
    kinds = frozenset(r.structured for r in requests if r.structured is not None)

    async def run() -> tuple[list[RequestResult], float, ServerCaps]:
        nonlocal requests
        async with make_client(config.base_url, config.api_key) as client:
            caps = ServerCaps(True, "none", config.model)
            timeout = config.request_timeout
            sender = Sender(client, config.base_url, caps, config.temperature, timeout)
            sender.caps = await probe_server(sender, pool, chat, kinds)
            requests = requests if sender.caps.token_ids else as_text(pool, requests)
            await warm_up(sender, pool, config.num_warmups, chat)
            progress = not config.disable_tqdm
            sent = await send_all(sender, requests, arrivals, config.max_concurrency, progress)
        return *sent, sender.caps

    results, duration, caps = asyncio.run(run())
    return {**summarize(results, duration, config), "server": asdict(caps)}


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
    return out | {f"p{q:g}_{name}_ms": percentile(ms, q) for q in pcts}


def _meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(values[k] * 1000 <= limit for k, limit in slos.items())


def summarize(
    results: Sequence[RequestResult], duration: float, config: BenchConfig
) -> dict[str, Any]:
    """vLLM-style summary of a run, plus each request's numbers (for plots) and, when
    requests carry tags, the same metrics per tag under `by_tag`."""
    out = metrics(results, duration, config)
    rate = config.request_rate if math.isfinite(config.request_rate) else "inf"
    out.update(date=time.strftime("%Y-%m-%d %H:%M:%S"), base_url=config.base_url,
               request_rate=rate, max_concurrency=config.max_concurrency, seed=config.seed,
               goodput_slos_ms=dict(config.goodput),
               requests=[per_request(r) for r in results])  # fmt: skip
    if tags := sorted({r.tag for r in results if r.tag}):
        out["by_tag"] = {t: metrics([r for r in results if r.tag == t], duration, config)
                         for t in tags}  # fmt: skip
    return out


def metrics(
    results: Sequence[RequestResult], duration: float, config: BenchConfig
) -> dict[str, Any]:
    """Counts, throughputs and latency distributions of one set of results."""
    ok = [r for r in results if r.success]
    known = [r for r in ok if r.expected_prompt_len is not None]
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    good = [r for r in ok if _meets_slos(r, config.goodput)]
    out: dict[str, Any] = {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "input_len_mismatches": sum(r.prompt_tokens != r.expected_prompt_len for r in known),
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_len for r in ok),
        "usage_missing": sum(not r.has_usage for r in ok), "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration, "total_token_throughput": (n_in + n_out) / duration,
        "request_goodput": len(good) / duration if config.goodput else None,
    }  # fmt: skip
    if constrained := [r for r in ok if r.structured is not None]:
        valid = sum(structured_valid(r.structured, r.text) for r in constrained)  # type: ignore[arg-type]
        out.update(structured_valid=valid, structured_invalid=len(constrained) - valid)
    pcts = config.percentiles
    out.update(distribution("ttft", [r.ttft for r in ok], pcts))
    out.update(distribution("tpot", [t for r in ok if (t := r.tpot) is not None], pcts))
    out.update(distribution("itl", [x for r in ok for x in r.itl], pcts))
    return out | distribution("e2el", [r.e2e for r in ok], pcts)


def per_request(r: RequestResult) -> dict[str, Any]:
    keys = ("success", "tag", "conversation", "prompt_tokens", "output_tokens", "cached_tokens")
    keys += ("finish_reason", "error", "structured")
    kept = r.structured is not None or r.conversation is not None
    return {k: getattr(r, k) for k in keys} | {
        "start_s": r.start, "ttft_s": r.ttft, "e2e_s": r.e2e,
        "itl_s": [round(x, 6) for x in r.itl], "text": r.text if kept else None,
    }  # fmt: skip

"""An in-process Backend for router tests, plus the tiny tokenizer and checks they share.

FakeBackend generates a deterministic token sequence per (prompt, seed), or a scripted one,
and honours the stopping parameters a real node would: max_tokens, min_tokens, EOS,
stop_token_ids, ignore_eos. It records every request and abort so tests can check them.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from pdserve.common.wire.messages import Error, Failure, Tokens
from pdserve.common.wire.payloads import TokenLogprobs
from pdserve.router.backend import Backend, GenerateRequest

FIRST_ORDINARY_ID = 5  # ids 0..4 are the tiny tokenizer's special tokens


@functools.cache
def tiny_tokenizer() -> Any:
    """The byte-level BPE tokenizer of the tiny test models (ChatML template), built once."""
    from pdserve.tiny_model import train_tokenizer

    return train_tokenizer(vocab_size=512, max_length=512)


ERROR_FIELDS = {"message", "type", "param", "code"}


def assert_error(response: Any, status: int, *fragments: str) -> dict[str, Any]:
    """The error of response, which must have this status and vLLM's envelope; its message
    must contain every fragment."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert error["code"] == status and isinstance(error["type"], str), error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


class FakeBackend(Backend):
    """Deterministic backend with configurable delays, scripted outputs and injected errors.

    outputs maps a prompt to the exact tokens to generate (then EOS); other prompts get a
    seeded pseudo-random sequence of ordinary tokens in which EOS appears at a fixed step
    (eos_at; None: never). error_after makes a request fail after that many tokens.
    """

    def __init__(
        self,
        vocab_size: int,
        eos_token_id: int,
        *,
        max_model_len: int = 256,
        first_token_delay: float = 0.0,
        token_delay: float = 0.0,
        tokens_per_event: int = 1,
        cached_tokens: int = 0,
        eos_at: int | None = None,
        error_after: int | None = None,
        outputs: dict[tuple[int, ...], list[int]] | None = None,
        scripted_all: list[int] | None = None,
    ) -> None:
        """`scripted_all`: what every prompt not in outputs is answered with."""
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.first_token_delay = first_token_delay
        self.token_delay = token_delay
        self.tokens_per_event = tokens_per_event
        self.cached_tokens = cached_tokens
        self.eos_at = eos_at
        self.error_after = error_after
        self.outputs = dict(outputs or {})
        self.scripted_all = scripted_all
        self.is_ready = True
        self.gauges: dict[str, float] = {}
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []  # request ids whose generator ran to its last event
        self.live = 0  # generate() calls not yet closed: a leak leaves this above zero
        # When set, requests wait for this event before their first token (overload tests).
        self.gate: asyncio.Event | None = None
        # When set, every request fails at once with this error, as a full cluster answers.
        self.unavailable: str | None = None
        # When set, every request fails at once with this error, as a crashed node answers.
        self.crash: str | None = None

    # ------------------------------------------------------------ Backend

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Error]:
        self.requests.append(request)
        self.live += 1
        events = self._events(request)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
            self.live -= 1

    async def _events(self, request: GenerateRequest) -> AsyncGenerator[Tokens | Error, None]:
        rid = request.request_id
        if self.unavailable is not None:
            yield Error(rid, self.unavailable, Failure.UNAVAILABLE)
            return
        if self.crash is not None:
            yield Error(rid, self.crash, Failure.INTERNAL)
            return
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.first_token_delay)
        stream = self._tokens(request)
        produced = 0
        first = True
        while True:
            batch, finish = self._next_batch(request, stream, produced)
            produced += len(batch)
            if self.error_after is not None and produced >= self.error_after:
                if batch:
                    yield Tokens(rid, tuple(batch))
                yield Error(rid, "injected failure", Failure.INTERNAL)
                return
            if rid in self.aborted:
                yield Tokens(rid, (), finish_reason="abort")
                return
            cached = min(self.cached_tokens, len(request.prompt_token_ids) - 1) if first else 0
            logprobs = tuple(self._logprobs(t, request.sampling.logprobs) for t in batch)
            yield Tokens(
                rid,
                tuple(batch),
                logprobs if request.sampling.logprobs is not None else (),
                finish or "",
                cached_tokens=cached,
            )
            first = False
            if finish is not None:
                self.finished.append(request.request_id)
                return
            await asyncio.sleep(self.token_delay)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def ready(self) -> bool:
        return self.is_ready

    def stats(self) -> dict[str, float]:
        return dict(self.gauges)

    # ------------------------------------------------------------ token sequence

    def expected_tokens(self, request: GenerateRequest) -> list[int]:
        """What generate() yields for request, all events joined (without aborts or errors)."""
        stream, out = self._tokens(request), []
        while True:
            batch, finish = self._next_batch(request, stream, len(out))
            out += batch
            if finish is not None:
                return out

    def _tokens(self, request: GenerateRequest) -> Callable[[int], int]:
        # Past a script's end comes EOS, then filler for requests that ignore EOS.
        scripted = self.outputs.get(tuple(request.prompt_token_ids), self.scripted_all)
        if scripted is not None:

            def scripted_token(step: int) -> int:
                if step < len(scripted):
                    return scripted[step]
                return self.eos_token_id if step == len(scripted) else FIRST_ORDINARY_ID + step % 50

            return scripted_token
        seed = -1 if request.sampling.seed is None else request.sampling.seed
        rng = random.Random(hash((tuple(request.prompt_token_ids), seed)))
        sequence = [rng.randrange(FIRST_ORDINARY_ID, self.vocab_size) for _ in range(1024)]
        return lambda step: self.eos_token_id if step == self.eos_at else sequence[step % 1024]

    def _next_batch(
        self, request: GenerateRequest, stream: Callable[[int], int], produced: int
    ) -> tuple[list[int], str | None]:
        """Up to tokens_per_event tokens from step produced on, and the finish they cause."""
        sampling = request.sampling
        batch: list[int] = []
        step = produced
        while len(batch) < self.tokens_per_event:
            token = stream(step)
            step += 1
            may_stop = produced + len(batch) >= sampling.min_tokens
            if token == self.eos_token_id and (sampling.ignore_eos or not may_stop):
                continue  # a real sampler would have picked another token
            batch.append(token)
            if may_stop and (token == self.eos_token_id or token in sampling.stop_token_ids):
                return batch, "stop"
            if produced + len(batch) >= sampling.max_tokens:
                return batch, "length"
        return batch, None

    @staticmethod
    def _logprobs(token: int, top_n: int | None) -> TokenLogprobs:
        top = tuple((token + k, -0.5 * (k + 1)) for k in range(top_n or 0))
        return TokenLogprobs(token, -0.25, top)

"""A request as the engine core sees it: token ids, progress, ownership of blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.wire.payloads import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """OpenAI finish_reason values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Request:
    """Mutable engine-side state of one sequence. Only the scheduler mutates progress fields.

    all_token_ids is prompt + generated so far; num_computed_tokens counts how many of them
    have KV in the cache. The model is run on all_token_ids[num_computed_tokens:].
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: float = 0.0
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Of prompt tokens 1, 2, ... (the first has none), as its prefill computes them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they go out once, with the first update
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that ended it, if any
    # For a request with structured_outputs, its Grammar (structured.py), which has accepted
    # every output token; None otherwise.
    grammar: Any = None
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        # Outputs given at creation come from another node (a resumed request).
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

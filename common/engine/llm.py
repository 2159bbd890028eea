"""Offline API: a colocated engine that takes a batch of prompts and returns their outputs."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from pdserve.common.engine.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.request import Request
from pdserve.common.wire.payloads import SamplingParams, TokenLogprobs

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

# The configs LLM's keywords fill, in LLMEngine's order; their field names do not overlap.
LLM_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int
    num_preemptions: int
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing
    # precedes it), as in vLLM.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    """`LLM(model_dir).generate(prompts, SamplingParams(...))`, vLLM-style.

    Every keyword but skip_tokenizer_init is a field of one of the engine's configs
    (common/engine/config.py), whose docstrings and `option` help texts say what it means, and
    takes that field's default: ModelConfig (dtype, device, quantization, enforce_eager, ...),
    CacheConfig (block_size, num_blocks, kv_cache_bytes, ...), SchedulerConfig (max_num_seqs,
    max_num_batched_tokens, policy, speculative_config: vLLM's JSON keys as a dict or text,
    ...), ParallelConfig (tensor_parallel_size, threads_per_rank, ...). `help(LLM)` and
    `inspect.signature(LLM)` list every one with its default; an unknown keyword is a
    TypeError, a bad value a ValueError.
    skip_tokenizer_init: take token-id prompts only (no tokenizer files needed).
    """

    def __init__(self, model: str, *, skip_tokenizer_init: bool = False, **options: Any) -> None:
        self.engine = LLMEngine(*llm_configs(model, options))
        self.tokenizer = None if skip_tokenizer_init else _load_tokenizer(model)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (they also exit when this one does)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        batch = _as_batch(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(batch) if isinstance(params, SamplingParams) else params
        if len(params_list) != len(batch):
            raise ValueError("need one SamplingParams per prompt")
        requests = [
            self.engine.add_request(
                f"gen-{next(self._ids)}", self._encode(p), sp, priority[i] if priority else 0
            )
            for i, (p, sp) in enumerate(zip(batch, params_list))
        ]
        while self.engine.has_unfinished:
            self.engine.step()
        return [self._output(r) for r in requests]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=False)")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=request.finish_reason.value if request.finish_reason else "abort",
            logprobs=list(request.output_logprobs)
            if request.sampling.logprobs is not None
            else None,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            prompt_logprobs=[None, *request.prompt_logprobs]
            if request.sampling.prompt_logprobs is not None
            else None,
        )


def llm_configs(
    model: str, options: dict[str, Any]
) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig]:
    """The engine's configs of `LLM(model, **options)`: each option to the config with a field
    of its name, every other field at the config's own default."""
    names = [{f.name for f in fields(cls)} - {"model_dir"} for cls in LLM_CONFIGS]
    unknown = sorted(set(options).difference(*names))
    if unknown:
        raise TypeError(f"LLM() got unknown options {unknown} (see help(LLM))")
    given = [{k: v for k, v in options.items() if k in own} for own in names]
    given[0]["model_dir"] = model
    return tuple(cls(**g) for cls, g in zip(LLM_CONFIGS, given))  # type: ignore[return-value]


def _signature() -> inspect.Signature:
    """LLM.__init__'s signature as `help` and editors should show it: every config field a
    keyword with the config's default (the function itself takes them as **options)."""
    own = list(inspect.signature(LLM.__init__).parameters.values())[:-1]  # but **options
    keyword = inspect.Parameter.KEYWORD_ONLY
    for cls in LLM_CONFIGS:
        own += [
            inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
            for f in fields(cls)
            if f.default is not MISSING  # model_dir is LLM's model
        ]
    return inspect.Signature(own, return_annotation=None)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]


def _as_batch(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)


def _load_tokenizer(model_dir: str):
    from pdserve.common.model.checkpoint import Checkpoint

    try:
        return Checkpoint.resolve(model_dir).tokenizer()
    except Exception as exc:  # a checkpoint without tokenizer files
        raise ValueError(
            f"cannot load a tokenizer from {model_dir}: {exc}; pass skip_tokenizer_init=True "
            "to use token-id prompts only"
        ) from exc

"""Offline API: a colocated engine that takes a batch of prompts and returns their outputs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

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
    """`LLM(model_dir).generate(prompts, SamplingParams(...))`, vLLM-style."""

    def __init__(
        self,
        model: str,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        device: str = "cpu",
        dtype: str = "auto",
        max_model_len: int | None = None,
        long_prefill_token_threshold: int = 0,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        seed: int = 0,
        kv_cache_bytes: int = 256 * 1024**2,
        skip_tokenizer_init: bool = False,
        enforce_eager: bool | None = None,
        load_format: str = "auto",
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        threads_per_rank: int | None = None,
        quantization: str = "auto",
        enable_expert_parallel: bool = False,
        compile_cache_dir: str | None = None,
    ) -> None:
        self.engine = LLMEngine(
            ModelConfig(
                model,
                dtype=dtype,
                device=device,
                seed=seed,
                enforce_eager=enforce_eager,
                load_format=load_format,
                quantization=quantization,
                enable_expert_parallel=enable_expert_parallel,
                compile_cache_dir=compile_cache_dir,
            ),
            CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_bytes=kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                long_prefill_token_threshold=long_prefill_token_threshold,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=policy,
            ),
            ParallelConfig(tensor_parallel_size, threads_per_rank),
        )
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

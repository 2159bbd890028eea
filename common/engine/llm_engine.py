"""The engine step every node runs: schedule, run, update."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.common.engine.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pdserve.common.engine.drafting import step_cost
from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.model_runner import LayerCall, ModelRunner
from pdserve.common.engine.request import Request
from pdserve.common.engine.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from pdserve.common.engine.structured import StructuredOutputs
from pdserve.common.model.checkpoint import Checkpoint
from pdserve.common.model.weights import model_fingerprint
from pdserve.common.spec.draft_model import DraftModelProposer
from pdserve.common.wire.payloads import KVLayout, SamplingParams

if TYPE_CHECKING:
    from pdserve.kv_store.pool_tiers import PoolTiers
    from pdserve.kv_store.tier import TierStats


class PrefillRate:
    """Prompt tokens per second of recent steps that prefilled (a moving average): nodes
    report it so the router can weigh prefilling on a prefill node against the decode node.
    Steps with few prompt tokens are left out: their time is mostly fixed cost. A step that
    also decoded counts its prompt tokens against its time less that of a decode-only step
    (also a moving average), so a decode node prefilling between decodes is not measured
    slower than it prefills."""

    def __init__(self, min_tokens: int = 32, weight: float = 0.2) -> None:
        self.min_tokens = min_tokens
        self.weight = weight
        self.tokens_per_s = 0.0  # 0: nothing measured yet
        self.decode_step_s = 0.0  # a step with decodes only (0: none seen yet)

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        # A verify step's drafts make it no prefill: its known tokens say.
        prefills = [seq.num_known_tokens for seq in output.seqs if seq.num_known_tokens > 1]
        tokens, decodes = sum(prefills), len(output.seqs) - len(prefills)
        if seconds <= 0:
            return
        if not tokens:
            self.decode_step_s = self._average(self.decode_step_s, seconds)
        elif tokens >= self.min_tokens:
            prefill_s = seconds - (self.decode_step_s if decodes else 0.0)
            rate = tokens / max(prefill_s, seconds / 2)
            self.tokens_per_s = self._average(self.tokens_per_s, rate)

    def _average(self, old: float, new: float) -> float:
        return new if not old else (1 - self.weight) * old + self.weight * new


class LLMEngine:
    """Scheduler + KV cache manager + model runner, in one process."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        parallel: ParallelConfig | None = None,
        decodes: bool = True,
    ) -> None:
        """`decodes`: False on a prefill node (its requests leave after the first token)."""
        spec = scheduler.speculative_config
        if decodes and spec is not None and parallel is not None:
            spec.check_decoding_tp(parallel.tensor_parallel_size)
        self.model_config = model
        self.runner = ModelRunner(
            model,
            cache,
            scheduler.max_num_seqs,
            scheduler.max_model_len,
            parallel,
            speculative=scheduler.speculative_config,
        )
        self.prefill_rate = PrefillRate()
        self.tiers = self._tiers(cache, parallel)
        self.kv = KVCacheManager(
            self.runner.num_blocks, cache.block_size, cache.enable_prefix_caching, self.tiers
        )
        self.max_model_len = self._max_model_len(scheduler)
        draft = self.runner.draft
        proposer = DraftModelProposer(draft, self.kv.block_ids) if draft is not None else None
        cost = step_cost(self.runner.verifies_compiled)
        self.scheduler = Scheduler(scheduler, self.kv, self.max_model_len, proposer, cost)
        self._structured: StructuredOutputs | None = None  # made on the first constraint

    def _tiers(self, cache: CacheConfig, parallel: ParallelConfig | None) -> PoolTiers | None:
        """The KV tiers under the pool (docs/kv_tiers.md), or None when none is asked for."""
        if not (cache.kv_offload_bytes or cache.kv_store) or not cache.enable_prefix_caching:
            return None
        if parallel is not None and parallel.tensor_parallel_size > 1:
            raise ValueError("KV tiers (--kv-offload-bytes, --kv-store) run at TP 1 only for now")
        from pdserve.kv_store.cost import LoadCost, PrefillCost  # kv_store is above the core
        from pdserve.kv_store.key import KeySpace
        from pdserve.kv_store.pool_tiers import open_pool_tiers

        space = KeySpace.of(self.kv_layout())
        cost = LoadCost(PrefillCost(), cache.kv_load_policy)
        caches, block_size = self.runner.kv_caches, cache.block_size
        return open_pool_tiers(
            cache.kv_offload_bytes, cache.kv_store, space, caches, block_size, cost
        )

    def _max_model_len(self, scheduler: SchedulerConfig) -> int:
        capacity = self.kv.capacity_tokens()
        limit = min(self.runner.arch.max_position_embeddings, capacity)
        if scheduler.max_model_len is None:
            return limit
        if scheduler.max_model_len > limit:
            raise ValueError(
                f"max_model_len {scheduler.max_model_len} exceeds what this engine can hold "
                f"({limit} tokens: model positions and KV cache capacity)"
            )
        return scheduler.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.arch.eos_token_ids

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> Request:
        request = self.new_request(
            request_id, prompt_token_ids, sampling, priority, output_token_ids
        )
        self.scheduler.add_request(request)
        return request

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: int = 0,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> Request:
        """A validated Request, not yet queued (a decode node reserves it instead).

        `output_token_ids` resumes a request another node started: they count as generated
        (max_tokens, stop checks, seeded draws) and are recomputed like a preempted request's.
        """
        vocab = self.runner.arch.vocab_size
        if any(not 0 <= t < vocab for t in [*prompt_token_ids, *output_token_ids]):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        grammar = None
        if sampling.structured_outputs is not None:
            grammar = self.structured.grammar(sampling.structured_outputs, output_token_ids)
        return Request(
            grammar=grammar,
            output_token_ids=list(output_token_ids),
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            arrival=time.monotonic(),
            priority=priority,
        )

    @property
    def structured(self) -> StructuredOutputs:
        """The grammar compiler for this model's tokenizer, made when first needed."""
        if self._structured is None:
            tokenizer = Checkpoint.resolve(self.model_config.model_dir).tokenizer()
            arch = self.runner.arch
            self._structured = StructuredOutputs(tokenizer, arch.vocab_size, arch.eos_token_ids)
        return self._structured

    def kv_layout(self) -> KVLayout:
        """What one page of this engine's KV cache means, as the KV handshake and the
        router's pairing compare it."""
        return self.runner.kv_layout(model_fingerprint(self.model_config.model_dir))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestUpdate]:
        """Schedule, run, update (a node schedules, then runs the batch itself: `run`)."""
        return self.run(self.scheduler.schedule())

    def run(
        self, output: SchedulerOutput, layer_call: LayerCall | None = None
    ) -> list[RequestUpdate]:
        """Run a scheduled batch and update its requests. `layer_call` runs inside the forward
        right after each layer wrote its K/V (a prefill node ships that layer's pages with it):
        the caller makes it from the batch it got from `scheduler.schedule()`, so the engine
        calls nothing back."""
        if output.empty:
            self.runner.forget(output.finished_ids)
            return []
        with self.kv.forward():  # the blocks this schedule evicted go to the tiers first
            start = time.perf_counter()
            sampled, prompt_lps = self.runner.execute(output, layer_call)
            seconds = time.perf_counter() - start
        self.prefill_rate.observe(output, seconds)
        if self.tiers is not None:  # the marginal prefill cost its load decisions weigh
            self.tiers.cost.observe_step(output, seconds)
        return self.scheduler.update(output, sampled, prompt_lps)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def broken(self) -> str | None:
        """Why the engine's tensor-parallel group cannot go on (a rank is gone), or None."""
        driver = self.runner.driver
        return None if driver is None else driver.broken()

    def tier_stats(self) -> tuple[TierStats, ...]:
        """Counters of each KV tier under the pool (hits, misses, bytes), nearest first."""
        return () if self.tiers is None else self.tiers.stats()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (nothing to do at TP 1) and close
        the KV tiers."""
        self.runner.close()
        if self.tiers is not None:
            self.tiers.close()

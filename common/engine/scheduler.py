"""Scheduler core: which tokens of which requests run in the next forward.

Pure Python, vLLM-v1 style: there is no separate "prefill phase"; every request simply has
num_computed_tokens < num_tokens, and a step gives each running request up to its missing
tokens (one for decode, a chunk for a prefill), then admits waiting requests while the token
budget lasts. Preemption frees a request's blocks and recomputes it later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.config import SchedulerConfig
from pdserve.common.engine.drafting import StepCost, create_drafter
from pdserve.common.engine.kv_cache_manager import KVCacheManager
from pdserve.common.engine.request import FinishReason, Request, RequestStatus
from pdserve.common.spec.base import Proposer
from pdserve.common.wire.messages import Tokens
from pdserve.common.wire.payloads import SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step: tokens to run, where they sit, and whether to sample."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_ids: tuple[int, ...]
    sample: bool  # True when this step completes the known sequence
    sampling: SamplingParams
    banned_token_ids: tuple[int, ...] = ()
    num_output_tokens: int = 0  # tokens sampled before this step (here or on another node)
    grammar: Any = None  # the request's Grammar: sample only what it allows
    # For a request with prompt_logprobs: the prompt tokens that follow this step's positions
    # (their logprobs come from this step's logits), and the top N to return with each.
    prompt_targets: tuple[int, ...] = ()
    prompt_target_pos: int = 0  # the position whose logits score prompt_targets[0]
    prompt_logprobs: int = 0
    # Speculative decoding: the last num_drafts of token_ids are drafted, not known; the step
    # samples at the last known token and at each draft, and verifies the drafts.
    num_drafts: int = 0

    @property
    def num_known_tokens(self) -> int:
        """Tokens of the request's own sequence this step computes (its drafts aside)."""
        return len(self.token_ids) - self.num_drafts

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    finished_ids: tuple[str, ...] = ()  # ended since the last step: runner drops their state

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


# What a step sampled for one request: a token, or the tokens a verify step emits in order.
Sampled = SampledToken | tuple[SampledToken, ...]


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one step did to one request: the new token and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...]
    finish_reason: FinishReason | None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first update only)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # first update only, when asked for

    def tokens(self) -> Tokens:
        """This update as a node sends it to the router that owns the request."""
        return Tokens(
            request_id=self.request_id,
            token_ids=self.new_token_ids,
            logprobs=self.new_logprobs,
            finish_reason=self.finish_reason.value if self.finish_reason else "",
            cached_tokens=self.cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass(slots=True)
class _StepBudget:
    tokens: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Running requests that decode (one token) and have not had their token yet: a prompt
    # chunk leaves room for them, so a long prefill never holds decodes back a whole step.
    decodes: int = 0


class Scheduler:
    """Waiting and running queues over one KVCacheManager."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        proposer: Proposer | None = None,  # a drafter built with the model (draft_model)
        step_cost: StepCost | None = None,  # what its verify steps cost (eager's by default)
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.reserved: dict[str, Request] = {}  # blocks held, KV arriving from a prefill node
        self._finished_ids: list[str] = []
        self.num_preemptions = 0  # since the engine started (the node's vLLM-style counter)
        self.drafter = create_drafter(config.speculative_config, proposer, step_cost)

    # -- admission -------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        limit = min(self.max_model_len, self.kv.capacity_tokens())
        if request.num_tokens > limit:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; this engine holds at most {limit}"
            )

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never run here."""
        self._validate(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.config.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=_priority_key))

    def abort(self, request_id: str) -> Request | None:
        """End a request wherever it is; idempotent (None when unknown or already gone)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return request

    # -- remote prefill (decode node) -----------------------------------------------------

    def reserve(self, request: Request) -> list[int] | None:
        """Hold blocks for the whole prompt until its KV arrives; None when there is no room.

        The prompt's leading blocks that this node's prefix cache holds (an earlier turn of
        the conversation, prompt and answer alike) are shared, as local prefix hits are:
        `request.num_cached_tokens` says how many tokens need no transfer. The new blocks
        stay out of the prefix index until admit_remote: until then they hold no valid KV.
        """
        self._validate(request)
        if len(self.running) + len(self.reserved) >= self.config.max_num_seqs:
            return None
        hits, n_cached = self.kv.get_computed_blocks(request)
        missing = request.num_tokens - n_cached
        if self.kv.allocate_slots(request, missing, hits, cache=False) is None:
            self.kv.free(request)
            return None
        request.num_cached_tokens = n_cached
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return self.kv.block_ids(request.request_id)

    def admit_remote(self, request_id: str, first: SampledToken) -> RequestUpdate | None:
        """The prompt's KV has arrived: run the request from its first sampled token on."""
        request = self.reserved.pop(request_id, None)
        if request is None:
            return None  # aborted meanwhile
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_blocks(request, request.num_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._accept(request, (first,))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = _StepBudget(self.config.max_num_batched_tokens)
        preempted = self._schedule_running(budget)
        if not preempted:
            self._schedule_waiting(budget)
        finished, self._finished_ids = tuple(self._finished_ids), []
        used = self.config.max_num_batched_tokens - budget.tokens
        return SchedulerOutput(tuple(budget.seqs), used, finished)

    def _chunk(self, request: Request, budget: _StepBudget, first: int) -> int:
        """How many of the request's missing tokens fit in this step."""
        n = request.num_tokens - first
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        room = budget.tokens if n == 1 else budget.tokens - budget.decodes
        return min(n, room)

    def _schedule_running(self, budget: _StepBudget) -> bool:
        """Give running requests their tokens, preempting the lowest priority on shortage."""
        preempted_any = False
        budget.decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            n = self._chunk(request, budget, request.num_computed_tokens)
            if request.num_tokens - request.num_computed_tokens == 1:
                budget.decodes -= 1
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts(request, n, budget)
            while self.kv.allocate_slots(request, n + len(drafts)) is None:
                if drafts:  # room for the known token alone goes before preempting anyone
                    drafts = []
                    continue
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, budget)
                preempted_any = True
                if victim is request:
                    break
            else:
                self._emit(request, n, budget, drafts)
                i += 1
        return preempted_any

    def _drafts(self, request: Request, n: int, budget: _StepBudget) -> list[int]:
        """Tokens to verify after a request's last known token: within the budget that every
        later decode's token leaves and the model's length; while bans are in force, only as
        many as keep every verified position before min_tokens (a step bans alike at each)."""
        missing = request.num_tokens - request.num_computed_tokens
        if self.drafter is None or n != 1 or missing != 1:
            return []
        room = min(budget.tokens - 1 - budget.decodes, self.max_model_len - request.num_tokens - 1)
        if self._banned(request):
            room = min(room, request.sampling.min_tokens - request.num_output_tokens - 1)
        return self.drafter.drafts(request, room)

    def _schedule_waiting(self, budget: _StepBudget) -> None:
        while self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, n_cached = self.kv.get_computed_blocks(request)
            if request.sampling.prompt_logprobs is not None:  # every position is computed
                hits, n_cached = type(hits)(), 0
            n = self._chunk(request, budget, n_cached)
            missing = request.num_tokens - n_cached
            if not self.config.enable_chunked_prefill and n < missing:
                break
            if self.kv.allocate_slots(request, n, hits) is None:
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = n_cached
            request.num_computed_tokens = n_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(request, n, budget)

    def _emit(
        self, request: Request, n: int, budget: _StepBudget, drafts: Sequence[int] = ()
    ) -> None:
        start = request.num_computed_tokens
        budget.tokens -= n + len(drafts)
        targets: tuple[int, ...] = ()
        if request.sampling.prompt_logprobs is not None:
            # Position p's logits score prompt token p + 1; only positions not scored yet.
            first = max(start, len(request.prompt_logprobs))
            end = min(start + n, request.num_prompt_tokens - 1)
            targets = tuple(request.prompt_token_ids[first + 1 : end + 1])
        budget.seqs.append(
            ScheduledSeq(
                request_id=request.request_id,
                token_ids=(*request.all_token_ids[start : start + n], *drafts),
                start_pos=start,
                block_ids=tuple(self.kv.block_ids(request.request_id)),
                sample=start + n == request.num_tokens,
                sampling=request.sampling,
                banned_token_ids=self._banned(request),
                num_output_tokens=request.num_output_tokens,
                grammar=request.grammar,
                prompt_targets=targets,
                prompt_target_pos=max(start, len(request.prompt_logprobs)),
                prompt_logprobs=request.sampling.prompt_logprobs or 0,
                num_drafts=len(drafts),
            )
        )

    def _banned(self, request: Request) -> tuple[int, ...]:
        """EOS and stop ids are forbidden until min_tokens have been produced."""
        if request.num_output_tokens >= request.sampling.min_tokens:
            return ()
        eos = () if request.sampling.ignore_eos else request.eos_token_ids
        return tuple(eos) + request.sampling.stop_token_ids

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]  # FCFS: the newest arrival goes first

    def _preempt(self, request: Request, budget: _StepBudget) -> None:
        # A victim already given tokens in this step (priority policy) loses them again.
        for seq in budget.seqs:
            if seq.request_id == request.request_id:
                budget.seqs.remove(seq)
                budget.tokens += len(seq.token_ids)
                self.kv.unschedule(request)
                break
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the forward -----------------------------------------------------------------

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, Sampled],
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[RequestUpdate]:
        """Advance progress by what ran, append sampled tokens (and the prompt logprobs the
        step computed), apply stop checks."""
        updates = []
        for seq in output.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.is_finished:
                continue  # aborted while its step ran
            request.num_computed_tokens += seq.num_known_tokens
            if prompt_logprobs and seq.request_id in prompt_logprobs:
                request.prompt_logprobs.extend(prompt_logprobs[seq.request_id])
            token = sampled.get(seq.request_id)
            if token is None:
                continue
            tokens = token if isinstance(token, tuple) else (token,)
            if seq.num_drafts:
                self._verified(request, seq, len(tokens) - 1)
            updates.append(self._accept(request, tokens))
            if seq.num_drafts and not request.is_finished:
                self.kv.trim(request)  # the blocks only rejected drafts took go back
        return updates

    def _verified(self, request: Request, seq: ScheduledSeq, accepted: int) -> None:
        """A verify step accepted its first `accepted` drafts: their KV, computed by the step,
        is the request's (the rejected positions' KV is overwritten when they are reached)."""
        assert self.drafter is not None, "drafts without a drafter"
        assert accepted <= seq.num_drafts, f"{accepted} accepted of {seq.num_drafts} drafts"
        request.num_computed_tokens += accepted
        self.drafter.observe(request.request_id, seq.num_drafts, accepted)

    def _accept(self, request: Request, tokens: Sequence[SampledToken]) -> RequestUpdate:
        first = not request.prompt_logprobs_sent
        request.prompt_logprobs_sent = True
        prompt_lps = tuple(request.prompt_logprobs) if first else ()
        if request.sampling.scores_prompt_only:
            self._finish(request, FinishReason.LENGTH)
            cached = request.num_cached_tokens
            return RequestUpdate(
                request.request_id, (), (), FinishReason.LENGTH, cached, prompt_lps
            )
        first_output = request.num_output_tokens == 0
        emitted, reason = self._append(request, tokens)
        if reason is not None:
            self._finish(request, reason)
        ids = tuple(t.token_id for t in emitted)
        lps = tuple(t.logprobs for t in emitted if t.logprobs is not None)
        cached = request.num_cached_tokens if first_output else 0
        return RequestUpdate(request.request_id, ids, lps, reason, cached, prompt_lps)

    def _append(
        self, request: Request, tokens: Sequence[SampledToken]
    ) -> tuple[Sequence[SampledToken], FinishReason | None]:
        """Append tokens in order, checking each against the stop conditions: the tokens
        appended (none past a stop) and why the request ends, if it does."""
        for i, token in enumerate(tokens):
            request.append_output(token.token_id, token.logprobs)
            reason = self._stop_reason(request, token.token_id)
            if request.grammar is not None and reason is None:
                reason = _follow_grammar(request, token.token_id)
            if reason is not None:
                return tokens[: i + 1], reason
        return tokens, None

    def release(self, request_id: str) -> None:
        """A prefill node hands a request off after its first token: drop it, keep its
        full blocks in the prefix cache (they become evictable)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, None)

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return FinishReason.STOP
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason | None) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.reserved.pop(request.request_id, None)
        self.kv.free(request)
        if self.drafter is not None:
            self.drafter.finish(request.request_id, request.all_token_ids)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)


def _follow_grammar(request: Request, token_id: int) -> FinishReason | None:
    """Advance the request's grammar by its new token: STOP once the grammar is complete (a
    structured output ends there, ignore_eos or not); ERROR if the grammar refuses the token,
    which the mask prevents unless the mask left nothing to choose."""
    if not request.grammar.accept(token_id):
        return FinishReason.ERROR
    return FinishReason.STOP if request.grammar.terminated else None


def _priority_key(request: Request) -> tuple[int, float]:
    """Lower value = served first (vLLM's convention)."""
    return (request.priority, request.arrival)

"""What a node reports about its engine, read from the engine alone: the load a heartbeat
carries (`engine_status`), the gauges of the health endpoint's /metrics (`engine_gauges`) and
the answer to a router's integrity check (`integrity_report`). The node adds the one thing only
it knows, whether it drains, and sends them (`loop.EngineNode`)."""

from __future__ import annotations

from pdserve.common.engine.drafting import SpecDecodeStats
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.node.membership import NodeStatus, PrefixChanges
from pdserve.common.node.tier_metrics import tier_counts, tier_report
from pdserve.common.wire.messages import IntegrityReport
from pdserve.common.wire.payloads import SpecDecodeCounts


def queued_tokens(engine: LLMEngine) -> int:
    """Prompt tokens waiting to be computed: what a prefill node is short of capacity by."""
    return sum(r.num_tokens - r.num_computed_tokens for r in engine.scheduler.waiting)


def engine_status(engine: LLMEngine, draining: bool) -> NodeStatus:
    """The engine's load, prefix-cache changes and KV tier counters for a heartbeat (the
    changes are taken: the next status has only newer ones)."""
    sched, kv = engine.scheduler, engine.kv
    tiers = tier_report(engine)
    return NodeStatus(
        free_blocks=kv.num_free_blocks,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        queued_tokens=queued_tokens(engine),
        draining=draining,
        prefill_rate=engine.prefill_rate.tokens_per_s,
        prefixes=prefix_changes(engine),
        spec_decode=spec_decode_counts(engine),
        kv_tiers=tier_counts(tiers),
        kv_tier_loaded_tokens=tiers.tokens_loaded,
    )


def prefix_changes(engine: LLMEngine) -> PrefixChanges | None:
    """What the pool's index and the host tier gained and lost since the last report, and the
    shared store's blocks it wrote or found gone (None: the node reports no prefixes). When either
    change log overflowed, both go whole: one reset replaces the router's whole view."""
    events, tiers = engine.kv.pool.prefix_events, engine.tiers
    if events is None:
        return None
    if tiers is not None and tiers.host_events.overflow:
        events.resync()
    reset, stored, removed = events.drain(engine.kv.pool.cached)
    if tiers is None:
        return PrefixChanges(reset, stored, removed)
    _, host_stored, host_removed = tiers.host_changes(snapshot=reset)
    shared_stored, shared_removed = tiers.take_shared_changes()
    return PrefixChanges(
        reset, stored, removed, host_stored, host_removed, shared_stored, shared_removed
    )


def spec_decode_counts(engine: LLMEngine) -> SpecDecodeCounts | None:
    """The drafter's counters as a heartbeat carries them (None without speculation)."""
    drafter = engine.scheduler.drafter
    if drafter is None:
        return None
    s = drafter.stats
    per_position = tuple(s.accepted_per_position)
    return SpecDecodeCounts(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, per_position)


def engine_gauges(engine: LLMEngine, queued: int, draining: bool) -> dict[str, float]:
    """The health endpoint's gauges and counters (`health.NODE_METRICS`, `NODE_COUNTERS`) a
    node of every role reports."""
    sched, kv = engine.scheduler, engine.kv
    total = max(1, kv.pool.num_blocks - 1)  # the null block is never free
    usage = 1.0 - kv.num_free_blocks / total
    return {
        "pdserve_node_queued_prefill_tokens": queued,
        "pdserve_node_kv_cache_usage": usage,  # the autoscalers' name (docs/deploy.md)
        "pdserve:kv_cache_usage_perc": usage,
        "pdserve_node_free_kv_blocks": kv.num_free_blocks,
        "pdserve_node_running_requests": len(sched.running),
        "pdserve_node_waiting_requests": len(sched.waiting),
        "pdserve_node_draining": float(draining),
        "pdserve_node_prefill_tokens_per_second": engine.prefill_rate.tokens_per_s,
        **{f"pdserve_node_{name}": value for name, value in spec_decode_counters(engine).items()},
        "pdserve:prefix_cache_queries": kv.stats.queries,
        "pdserve:prefix_cache_hits": kv.stats.hits,
        "pdserve:num_preemptions": sched.num_preemptions,
    }


def spec_decode_counters(engine: LLMEngine) -> dict[str, float]:
    """vLLM's `spec_decode_*` counters of the engine's drafter (0 without speculation)."""
    drafter = engine.scheduler.drafter
    return (drafter.stats if drafter is not None else SpecDecodeStats()).counters()


def integrity_report(engine: LLMEngine, nonce: int) -> IntegrityReport:
    """The engine's block bookkeeping checked (`LLMEngine.check_integrity`), as a router's
    `CheckIntegrity` asked: a failed check is reported, not raised."""
    kv = engine.kv
    try:
        engine.check_integrity()
        ok, detail = True, ""
    except AssertionError as exc:
        ok, detail = False, str(exc)
    return IntegrityReport(
        nonce=nonce,
        ok=ok,
        detail=detail,
        num_blocks=kv.pool.num_blocks - 1,
        free_blocks=kv.num_free_blocks,
        cached_blocks=len(kv.pool.cached),
        live_requests=tuple(engine.scheduler.requests),
    )

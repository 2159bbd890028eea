"""What a node reports is read off its engine (`common/node/reports.py`): a heartbeat's load and
prefix-cache changes, the /metrics gauges and the integrity report, on an engine that holds one
request part-way through its prompt."""

from __future__ import annotations

from pdserve.common.engine.kv_cache_manager import PrefixEvents, hash_token_blocks
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.node.health import NODE_COUNTERS, NODE_METRICS
from pdserve.common.node.reports import engine_gauges, engine_status, integrity_report
from pdserve.common.wire.payloads import SamplingParams

BLOCK, POOL, PROMPT = 4, 8, list(range(1, 11))  # POOL: blocks besides the null block


def engine(model_dir: str) -> LLMEngine:
    """An engine whose steps take one block of the prompt each (chunked prefill)."""
    llm = LLM(
        model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK,
        num_blocks=POOL + 1,
        max_num_batched_tokens=BLOCK,
    )
    llm.engine.kv.pool.prefix_events = PrefixEvents()
    return llm.engine


def test_status_and_gauges_follow_a_request_through_its_first_chunk(tiny_model_dir) -> None:
    e = engine(str(tiny_model_dir("llama")))
    e.add_request("r", PROMPT, SamplingParams(max_tokens=2))
    waiting = engine_status(e, draining=False)
    assert (waiting.num_waiting, waiting.num_running) == (1, 0)
    assert (waiting.queued_tokens, waiting.free_blocks) == (len(PROMPT), POOL)
    e.step()  # the first block of the prompt is computed and cached
    running = engine_status(e, draining=True)
    assert (running.num_waiting, running.num_running, running.queued_tokens) == (0, 1, 0)
    assert running.draining and running.free_blocks < POOL
    assert running.prefixes.stored == tuple(hash_token_blocks(PROMPT[:BLOCK], BLOCK))
    assert engine_status(e, draining=True).prefixes.stored == ()  # taken by the last status
    gauges = engine_gauges(e, queued=3, draining=True)
    assert set(gauges) < {*NODE_METRICS, *NODE_COUNTERS}  # decode adds its received bytes
    assert gauges["pdserve_node_kv_cache_usage"] == 1 - running.free_blocks / POOL
    assert gauges["pdserve:kv_cache_usage_perc"] == gauges["pdserve_node_kv_cache_usage"]
    assert gauges["pdserve:prefix_cache_queries"] == len(PROMPT)  # looked up once, no hit
    assert gauges["pdserve:prefix_cache_hits"] == gauges["pdserve:num_preemptions"] == 0
    assert gauges["pdserve_node_queued_prefill_tokens"] == 3
    assert gauges["pdserve_node_draining"] == 1.0


def test_integrity_report_says_what_is_wrong_instead_of_raising(tiny_model_dir) -> None:
    e = engine(str(tiny_model_dir("llama")))
    e.add_request("r", PROMPT, SamplingParams(max_tokens=2))
    e.step()
    report = integrity_report(e, nonce=7)
    assert (report.nonce, report.ok, report.live_requests) == (7, True, ("r",))
    assert (report.num_blocks, report.free_blocks, report.cached_blocks) == (POOL, POOL - 1, 1)
    free = next(b for b in e.kv.pool.blocks[1:] if b.ref_cnt == 0)
    free.ref_cnt = 1  # a free block that claims an owner
    broken = integrity_report(e, nonce=8)
    assert not broken.ok and "mismatch" in broken.detail

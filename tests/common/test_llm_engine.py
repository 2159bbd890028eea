"""LLMEngine.step and run: a batch's layer call runs inside its forward, layer by layer."""

from __future__ import annotations

from pdserve.common.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.common.engine.llm_engine import LLMEngine, PrefillRate
from pdserve.common.engine.model_runner import LayerCall
from pdserve.common.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.common.wire.payloads import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def engine(model_dir) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir)),
        CacheConfig(block_size=4, num_blocks=32),
        SchedulerConfig(max_num_batched_tokens=8),
    )


def test_a_layer_call_runs_after_every_layer_of_the_batch_it_was_made_for(tiny_model_dir) -> None:
    """A node takes the batch from the scheduler, makes the batch's layer call, and hands both
    to `run`: the engine calls nothing back."""
    hooked, plain = engine(tiny_model_dir("llama")), engine(tiny_model_dir("llama"))
    batches: list[SchedulerOutput] = []
    layers: list[tuple[int, int]] = []  # (batch, layer)

    def layer_call(batch: int) -> LayerCall | None:
        if batch == 2:
            return None  # nothing to do for this batch
        return LayerCall(lambda layer: layers.append((batch, layer)))

    for e in (hooked, plain):
        e.add_request("r", list(range(1, 13)), GREEDY)  # 12 tokens: 2 chunks of at most 8
    got, want = [], []
    while hooked.has_unfinished:
        batches.append(hooked.scheduler.schedule())
        got += hooked.run(batches[-1], layer_call(len(batches)))
        want += plain.step()
    n = hooked.runner.arch.num_layers
    assert [len(b.seqs[0].token_ids) for b in batches] == [8, 4, 1, 1]
    assert layers == [(b, i) for b in (1, 3, 4) for i in range(n)]
    assert got == want  # the call only observes


def test_prefill_rate_counts_prompt_tokens_against_prefill_time():
    def seq(n: int) -> ScheduledSeq:
        return ScheduledSeq("r", tuple(range(n)), 0, (1,), True, SamplingParams())

    rate = PrefillRate(min_tokens=32, weight=0.5)
    rate.observe(SchedulerOutput((seq(8),), 8), 1.0)  # too few prompt tokens: fixed cost
    assert rate.tokens_per_s == 0.0
    rate.observe(SchedulerOutput((seq(100),), 100), 0.5)
    assert rate.tokens_per_s == 200.0
    rate.observe(SchedulerOutput((seq(1), seq(1)), 2), 0.1)  # decodes only
    assert rate.decode_step_s == 0.1
    rate.observe(SchedulerOutput((seq(100), seq(1)), 101), 0.6)  # 0.5 s of it prefilled
    assert rate.tokens_per_s == 200.0
    rate.observe(SchedulerOutput((seq(100),), 100), 0.25)
    assert rate.tokens_per_s == 300.0  # moving average of 200 and 400

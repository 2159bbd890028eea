"""LLMEngine.step: the layer hook sees each batch and runs inside its forward, layer by layer."""

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


def test_the_layer_hook_runs_after_every_layer_of_every_batch(tiny_model_dir) -> None:
    hooked, plain = engine(tiny_model_dir("llama")), engine(tiny_model_dir("llama"))
    batches: list[SchedulerOutput] = []
    layers: list[tuple[int, int]] = []  # (batch, layer)

    def on_layer(output: SchedulerOutput):
        batches.append(output)
        if len(batches) == 2:
            return None  # nothing to do for this batch
        batch = len(batches)
        return LayerCall(lambda layer: layers.append((batch, layer)))

    for e in (hooked, plain):
        e.add_request("r", list(range(1, 13)), GREEDY)  # 12 tokens: 2 chunks of at most 8
    got, want = [], []
    while hooked.has_unfinished:
        got += hooked.step(on_layer=on_layer)
        want += plain.step()
    n = hooked.runner.arch.num_layers
    assert [len(b.seqs[0].token_ids) for b in batches] == [8, 4, 1, 1]
    assert layers == [(b, i) for b in (1, 3, 4) for i in range(n)]
    assert got == want  # the hook only observes


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

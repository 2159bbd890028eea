"""The model runner's sampling inputs (scripts/mutation.sh showed them unpinned): each sampled
row gets its bans and its request's own seeded generator, placed past the draws the request
already made (elsewhere, too), kept across steps and dropped when the request ends."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.sampler import make_generator, skip_draws
from pdserve.common.engine.scheduler import ScheduledSeq
from pdserve.common.wire.payloads import SamplingParams

VOCAB = 16


def runner() -> SimpleNamespace:
    """What _sampling_row and forget read of a runner: no model needed."""
    return SimpleNamespace(
        generators={}, device=torch.device("cpu"), arch=SimpleNamespace(vocab_size=VOCAB)
    )


def seq(rid: str, seed: int | None, outputs: int = 0, banned: tuple[int, ...] = ()) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=rid,
        token_ids=(1,),
        start_pos=4,
        block_ids=(1,),
        sample=True,
        sampling=SamplingParams(seed=seed),
        banned_token_ids=banned,
        num_output_tokens=outputs,
    )


def next_draw(generator: torch.Generator) -> list[float]:
    return torch.empty(VOCAB).exponential_(generator=generator).tolist()


def test_a_row_carries_its_bans_and_an_unseeded_row_no_generator() -> None:
    r = runner()
    row = ModelRunner._sampling_row(r, seq("a", None, banned=(2, 3)))  # type: ignore[arg-type]
    assert row.banned_token_ids == (2, 3) and row.generator is None and r.generators == {}


def test_a_seeded_request_goes_on_past_the_draws_it_made_elsewhere() -> None:
    row = ModelRunner._sampling_row(runner(), seq("a", 7, outputs=3))  # type: ignore[arg-type]
    reference = make_generator(7, "cpu")
    skip_draws(reference, 3, VOCAB)
    assert row.generator is not None
    assert next_draw(row.generator) == next_draw(reference)


def test_a_seeded_generator_is_kept_across_steps_and_dropped_at_the_end() -> None:
    r = runner()
    first = ModelRunner._sampling_row(r, seq("a", 7)).generator  # type: ignore[arg-type]
    ModelRunner._sampling_row(r, seq("b", 8))  # type: ignore[arg-type]
    again = ModelRunner._sampling_row(r, seq("a", 7, outputs=1)).generator  # type: ignore[arg-type]
    assert again is first and r.generators["a"] is first
    ModelRunner.forget(r, ("a", "gone"))  # type: ignore[arg-type]
    assert list(r.generators) == ["b"]


def prepared(*seqs: ScheduledSeq):  # noqa: ANN201 (ForwardInputs)
    r = SimpleNamespace(block_size=4, device=torch.device("cpu"))
    r._to_device = lambda lists, dtype: ModelRunner._to_device(r, lists, dtype)  # type: ignore[arg-type]
    return ModelRunner.prepare(r, seqs)  # type: ignore[arg-type]


def step_seq(rid: str, tokens: int, sample: bool = True, drafts: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, tuple(range(1, tokens + 1)), 4, (1, 2, 3), sample, SamplingParams(),
                        num_drafts=drafts)  # fmt: skip


def test_a_step_that_samples_every_token_in_order_is_marked_so() -> None:
    # The compiled CPU step hands such a step's logits to the sampler without the index copy;
    # any other step must keep it (a prefill chunk's last token only, an unsampled chunk).
    decode = prepared(step_seq("a", 1), step_seq("b", 1), step_seq("c", 1))
    assert decode.every_row and decode.logit_indices.tolist() == [0, 1, 2]
    verify = prepared(step_seq("a", 3, drafts=2), step_seq("b", 1))
    assert verify.every_row and verify.logit_indices.tolist() == [0, 1, 2, 3]
    chunk = prepared(step_seq("a", 1), step_seq("b", 5))
    assert not chunk.every_row and chunk.logit_indices.tolist() == [0, 5]
    unsampled = prepared(step_seq("a", 1, sample=False), step_seq("b", 1))
    assert not unsampled.every_row and unsampled.logit_indices.tolist() == [1]

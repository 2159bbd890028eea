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

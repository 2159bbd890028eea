"""The usage block's sums (scripts/mutation.sh showed them unpinned): totals add up, and each
prompt counts its own choices' best cache hit, not another prompt's."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.dialects import usage_info


@dataclass(frozen=True)
class Counted:
    """What usage_info reads of a choice."""

    prompt_index: int
    num_tokens: int
    cached_tokens: int


def test_totals_add_prompt_and_completion_tokens() -> None:
    prompts = [[1, 2, 3], [4, 5]]
    choices = [Counted(0, 4, 0), Counted(0, 6, 0), Counted(1, 1, 0)]
    usage = usage_info(prompts, choices)  # type: ignore[arg-type]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 11, 16)


def test_cached_tokens_take_each_prompts_own_best_hit() -> None:
    prompts = [[1] * 8, [2] * 8, [3] * 8]
    choices = [Counted(0, 1, 5), Counted(0, 1, 2), Counted(1, 1, 1), Counted(2, 1, 0)]
    usage = usage_info(prompts, choices)  # type: ignore[arg-type]
    assert usage.prompt_tokens_details.cached_tokens == 5 + 1 + 0

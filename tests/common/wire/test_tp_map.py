"""The slices a prefill group at TP p sends a decode group at TP d: every receiving rank gets
each of its KV heads exactly once, from a rank that holds it, at the right offsets."""

from __future__ import annotations

import itertools

import pytest

from pdserve.common.wire.payloads import HeadSlice, rank_kv_heads, transfer_plan

SIZES = (1, 2, 4)


@pytest.mark.parametrize(
    ("kv_heads", "p", "d"),
    [(4, p, d) for p, d in itertools.product(SIZES, SIZES)]
    + [(2, 4, 1), (2, 1, 4), (2, 4, 4), (2, 4, 2), (3, 3, 1), (3, 1, 3), (1, 4, 2)],
)
def test_each_receiving_rank_gets_each_of_its_heads_once(kv_heads: int, p: int, d: int) -> None:
    plan = transfer_plan(kv_heads, p, d)
    for dst in range(d):
        held = rank_kv_heads(kv_heads, d, dst)
        got = []
        for s in (s for s in plan if s.dst_rank == dst):
            src_heads = rank_kv_heads(kv_heads, p, s.src_rank)
            heads = range(s.first, s.first + s.count)
            assert set(heads) <= set(src_heads), f"{s} reads heads its sender lacks"
            assert s.src_offset == s.first - src_heads.start
            assert s.dst_offset == s.first - held.start
            got += heads
        assert sorted(got) == list(held)


def test_plans_named_by_hand() -> None:
    # P TP 1 -> D TP 2: rank 0 of the prefill group sends each decode rank its half.
    assert transfer_plan(4, 1, 2) == (HeadSlice(0, 0, 0, 2, 0, 0), HeadSlice(0, 1, 2, 2, 2, 0))
    # P TP 2 -> D TP 1: the decode rank gathers both halves.
    assert transfer_plan(4, 2, 1) == (HeadSlice(0, 0, 0, 2, 0, 0), HeadSlice(1, 0, 2, 2, 0, 2))
    # P TP 4 over 2 heads (replicated on ranks 0-1 and 2-3) -> D TP 4: receivers spread over
    # the holders.
    assert [(s.src_rank, s.dst_rank) for s in transfer_plan(2, 4, 4)] == [
        (0, 0),
        (1, 1),
        (2, 2),
        (3, 3),
    ]


@pytest.mark.parametrize(("kv_heads", "size"), [(4, 3), (2, 3), (6, 4), (3, 2)])
def test_a_size_that_cannot_hold_the_heads_is_refused_by_name(kv_heads: int, size: int) -> None:
    with pytest.raises(ValueError, match=f"{kv_heads} KV heads do not split across {size} ranks"):
        transfer_plan(kv_heads, size, 1)
    with pytest.raises(ValueError, match=f"{kv_heads} KV heads do not split across {size} ranks"):
        transfer_plan(kv_heads, 1, size)

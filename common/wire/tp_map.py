"""Which KV heads each rank of a tensor-parallel group holds, and which slices a prefill group
at TP p sends to a decode group at TP d. Torch-free: the model's shards, the KV connectors and
the router's pairing all read these same functions.

KV heads split evenly when the group's size divides their number; when the size is a multiple
of it, each head is held by `size // num_kv_heads` consecutive ranks (replicated). Any other
size cannot hold the model's KV and is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass


def check_kv_split(num_kv_heads: int, size: int) -> None:
    """ValueError naming both numbers when `size` ranks cannot hold `num_kv_heads` heads."""
    if size < 1:
        raise ValueError(f"a tensor-parallel group needs at least one rank, got {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads do not split across {size} ranks (nor replicate: "
            f"{size} is not a multiple of {num_kv_heads})"
        )


def rank_kv_heads(num_kv_heads: int, size: int, rank: int) -> range:
    """The model's KV heads that rank `rank` of `size` holds."""
    check_kv_split(num_kv_heads, size)
    if size <= num_kv_heads:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    first = rank // (size // num_kv_heads)
    return range(first, first + 1)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One sending rank's share of one receiving rank's KV: the model's heads
    [first, first + count), found at `src_offset` among the sender's heads and written at
    `dst_offset` among the receiver's."""

    src_rank: int
    dst_rank: int
    first: int
    count: int
    src_offset: int
    dst_offset: int


def transfer_plan(num_kv_heads: int, send_tp: int, recv_tp: int) -> tuple[HeadSlice, ...]:
    """Every slice a group at TP `send_tp` sends to one at TP `recv_tp`: each receiving rank
    gets each of its heads exactly once. Where several senders hold a head (replicated), the
    receivers spread over them (receiver j reads from holder j mod holders)."""
    check_kv_split(num_kv_heads, send_tp)
    check_kv_split(num_kv_heads, recv_tp)
    senders = [rank_kv_heads(num_kv_heads, send_tp, i) for i in range(send_tp)]
    plan: list[HeadSlice] = []
    for dst in range(recv_tp):
        held = rank_kv_heads(num_kv_heads, recv_tp, dst)
        for head in held:
            holders = [i for i, heads in enumerate(senders) if head in heads]
            src = holders[dst % len(holders)]
            last = plan[-1] if plan else None
            if (
                last
                and (last.dst_rank, last.src_rank) == (dst, src)
                and (last.first + last.count == head)
            ):
                plan[-1] = HeadSlice(
                    src, dst, last.first, last.count + 1, last.src_offset, last.dst_offset
                )
            else:
                offsets = (head - senders[src].start, head - held.start)
                plan.append(HeadSlice(src, dst, head, 1, *offsets))
    return tuple(plan)

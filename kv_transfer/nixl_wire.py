"""What the nixl connector's two ends say beside NIXL's WRITEs: the side-channel messages that
announce, cancel and settle transfers, and the checksum of the pages written (see
`nixl_connector`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import msgpack
import torch

from pdserve.common.wire.messages import Message
from pdserve.kv_transfer.wire import kv_message

# The checksum of a transfer's pages (see `pages_digest`).
NIXL_CHECKSUM = "pdserve-nixl-pages/2"
_MASK64 = (1 << 64) - 1


# -- side-channel messages --------------------------------------------------------------------


@kv_message
@dataclass(frozen=True, slots=True)
class KVExpect(Message):
    """Receiver -> every sender: the blocks reserved for a transfer and the heads of the
    receiver's cache it fills, [first_head, first_head + num_heads): the only bytes a sender
    may write for it (a tensor-parallel slice fills some heads of each block)."""

    TYPE: ClassVar[str] = "kvx.expect"
    xfer_id: str
    block_ids: tuple[int, ...]
    first_head: int
    num_heads: int

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)


@kv_message
@dataclass(frozen=True, slots=True)
class KVCancel(Message):
    """Receiver -> every sender: never write this transfer again; answer KVSettled."""

    TYPE: ClassVar[str] = "kvx.cancel"
    xfer_id: str


@kv_message
@dataclass(frozen=True, slots=True)
class KVSettled(Message):
    """Sender -> receiver: nothing of this transfer is in flight from here, and nothing more
    will be written."""

    TYPE: ClassVar[str] = "kvx.settled"
    xfer_id: str


# -- checksums ------------------------------------------------------------------------------------


_GATHER_BYTES = 64 << 20  # scattered pages are summed through gathers of at most this


def page_sums(
    cache: torch.Tensor, blocks: Sequence[int], heads: range | None = None
) -> torch.Tensor:
    """[len(blocks), planes] int64: the word sums (mod 2**64) of each plane of each block (K
    and V; or the one latent of MLA) in a [planes, num_blocks, ...] layer cache, or with
    `heads` of only those KV heads of it (a tensor-parallel slice). Runs of contiguous whole
    blocks are summed in place; other pages are gathered in bounded chunks first. No sync
    (CUDA)."""
    if not blocks:
        return torch.zeros(0, cache.shape[0], dtype=torch.int64, device=cache.device)
    if heads is not None and len(heads) != cache.shape[3]:
        return _gathered_sums(cache, blocks, heads).t()
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    ids = [blocks[i] for i in order]
    runs = _runs(ids)
    if len(runs) * 8 <= len(ids):  # mostly contiguous
        words = _words(cache)  # [planes, num_blocks, W]
        sums = torch.cat([words[:, b0 : b0 + n].sum(-1) for b0, n in runs], dim=1)
    else:
        sums = _gathered_sums(cache, ids, None)
    back = torch.empty_like(sums)
    back[:, order] = sums  # the caller's order
    return back.t()


def _gathered_sums(cache: torch.Tensor, blocks: Sequence[int], heads: range | None) -> torch.Tensor:
    """[planes, len(blocks)] word sums of each block (of its `heads` only, when given),
    gathered at most _GATHER_BYTES at a time."""
    pages = cache if heads is None else cache[:, :, :, heads.start : heads.stop]  # a view
    index = torch.tensor(list(blocks), device=cache.device)
    page_bytes = pages.shape[0] * pages[0, 0].numel() * cache.element_size()
    step = max(1, _GATHER_BYTES // page_bytes)
    parts = [pages[:, index[i : i + step]] for i in range(0, len(blocks), step)]
    return torch.cat([_words(part.contiguous()).sum(-1) for part in parts], dim=1)


PlaneSums = tuple[int, ...]  # one page's word sum per plane (K, V; or the latent)


def pages_digest(sums: dict[int, dict[int, PlaneSums]]) -> int:
    """The transfer checksum (`pdserve-nixl-pages/2`) of per-page sums, layer -> destination
    block -> a sum per plane: per layer and plane, the plain sum and the sum weighted by each
    page's rank (1, 2, ...) among the layer's destination blocks, mod 2**64, hashed. A
    changed byte changes a plain sum (as in `page_checksum`); a page written to the wrong
    block or missing changes a weighted one or the count."""
    words: list[int] = []
    for layer in sorted(sums):
        pages = sums[layer]
        planes = len(next(iter(pages.values()), ()))
        plain, ranked = [0] * planes, [0] * planes
        for rank, block in enumerate(sorted(pages), start=1):
            for plane, value in enumerate(pages[block]):
                plain[plane] += value
                ranked[plane] += rank * value
        words += [layer, len(pages), *(x & _MASK64 for x in (*plain, *ranked))]
    return int.from_bytes(hashlib.blake2b(msgpack.packb(words), digest_size=8).digest(), "little")


def collect_sums(
    parts: Sequence[tuple[int, Sequence[int], torch.Tensor]],
) -> dict[int, dict[int, PlaneSums]]:
    """(layer, destination blocks, page_sums) in the order they were written -> the sums of
    each page's last write."""
    out: dict[int, dict[int, PlaneSums]] = {}
    for layer, dsts, part in parts:
        pages = out.setdefault(layer, {})
        for dst, plane_sums in zip(dsts, part.tolist(), strict=True):
            pages[dst] = tuple(x & _MASK64 for x in plane_sums)
    return out


def _words(cache: torch.Tensor) -> torch.Tensor:
    """A [planes, num_blocks, ...] layer cache as [planes, num_blocks, W] int64 words (a copy
    only when a block's bytes are not a whole number of words)."""
    raw = cache.reshape(cache.shape[0], cache.shape[1], -1).view(torch.uint8)
    if raw.shape[2] % 8:
        return raw.to(torch.int64)
    return raw.view(torch.int64)


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first block, length) of each run of consecutive ids in a sorted list."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((ids[start], i - start))
            start = i
    return runs

"""Per-transfer accounting on both ends; pure Python, no sockets, no tensors.

The sender books every frame it put on the transport; the receiver books every frame it
wrote. `send_done` carries the sender's totals, and a transfer is ok only if the receiver's
totals equal them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from pdserve.common.wire.payloads import FirstToken
from pdserve.kv_transfer.base import TransferResult
from pdserve.kv_transfer.wire import CHECKSUM_SCHEME, KVDone, KVPage, combine, frame_digest, resolve

# How many finished or cancelled xfer ids to remember, to tell "late" from "never heard of".
_RECENT = 4096


@dataclass
class _Outbound:
    pages_per_layer: list[int]
    # checksums may be device tensors resolved only at send_done, to keep send_layer async
    frames: list[tuple[int, tuple[int, ...], int | torch.Tensor]] = field(default_factory=list)


class SendBook:
    """What a sender has sent, per open transfer."""

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._open: dict[str, _Outbound] = {}

    def record(self, page: KVPage, checksum: int | torch.Tensor) -> None:
        out = self._open.setdefault(page.xfer_id, _Outbound([0] * self._num_layers))
        out.pages_per_layer[page.layer] += len(page.dst_block_ids)
        out.frames.append((page.layer, page.dst_block_ids, checksum))

    def close(self, xfer_id: str, first: FirstToken) -> KVDone:
        """The done message for `xfer_id`; a transfer with no frames is legal (all cached)."""
        out = self._open.pop(xfer_id, None) or _Outbound([0] * self._num_layers)
        digest = combine(frame_digest(lay, ids, resolve(ck)) for lay, ids, ck in out.frames)
        return KVDone(xfer_id, first, digest, tuple(out.pages_per_layer), CHECKSUM_SCHEME)


@dataclass
class _Inbound:
    block_ids: frozenset[int]
    pages_per_layer: list[int]
    heads: range | None = None  # the cache's KV heads its pages fill (None: all of them)
    digests: list[int] = field(default_factory=list)
    inflight: int = 0
    problems: list[str] = field(default_factory=list)
    done: KVDone | None = None


class ReceiveBook:
    """Expected transfers on a receiver, the frames written into them, and refusal counters.

    Frame life: `admit` (header arrived; refused frames are counted and must not be written)
    -> `land` (bytes arrived; True means write them now) or `fail`. A transfer finishes once
    its done message is in and no admitted frame is still in flight.
    """

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._live: dict[str, _Inbound] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # xfer id -> "cancelled" | "finished"
        self.counters: Counter[str] = Counter()
        self.pages_received = 0  # pages (one block of one layer) written, for metrics

    def expect(self, xfer_id: str, block_ids: list[int], heads: range | None = None) -> None:
        if xfer_id in self._live:
            raise ValueError(f"transfer {xfer_id!r} is already expected")
        self._gone.pop(xfer_id, None)
        self._live[xfer_id] = _Inbound(frozenset(block_ids), [0] * self._num_layers, heads)

    def heads(self, xfer_id: str) -> range | None:
        """The KV heads a live transfer fills (None: all, or not live)."""
        inbound = self._live.get(xfer_id)
        return None if inbound is None else inbound.heads

    def cancel(self, xfer_id: str) -> None:
        if self._live.pop(xfer_id, None) is not None:
            self._forget(xfer_id, "cancelled")

    def is_live(self, xfer_id: str) -> bool:
        return xfer_id in self._live

    def admit(self, page: KVPage) -> bool:
        inbound = self._lookup(page.xfer_id, "frame")
        if inbound is None:
            return False
        if inbound.done is not None:
            self.counters["frame_after_done"] += 1
            return False
        outside = [b for b in page.dst_block_ids if b not in inbound.block_ids]
        if outside:
            self.counters["block_outside_reservation"] += 1
            inbound.problems.append(f"layer {page.layer}: refused blocks {outside[:8]}")
            return False
        inbound.inflight += 1
        return True

    def land(self, page: KVPage, checksum: int) -> bool:
        """Book an admitted frame's bytes; False (counted) if the transfer went away meanwhile."""
        inbound = self._live.get(page.xfer_id)
        if inbound is None:
            self.counters["late_frame"] += 1
            return False
        inbound.inflight -= 1
        inbound.pages_per_layer[page.layer] += len(page.dst_block_ids)
        self.pages_received += len(page.dst_block_ids)
        inbound.digests.append(frame_digest(page.layer, page.dst_block_ids, checksum))
        return True

    def fail(self, page: KVPage, reason: str) -> None:
        """An admitted frame whose bytes never arrived or were unusable."""
        self.counters["bad_frame"] += 1
        inbound = self._live.get(page.xfer_id)
        if inbound is not None:
            inbound.inflight -= 1
            inbound.problems.append(f"layer {page.layer}: {reason}")

    def on_done(self, done: KVDone) -> None:
        inbound = self._lookup(done.xfer_id, "done")
        if inbound is None:
            return
        if inbound.done is not None or len(done.pages_per_layer) != self._num_layers:
            self.counters["bad_done"] += 1
            return
        inbound.done = done

    def finished(self) -> list[TransferResult]:
        """Results of transfers whose done is in and whose frames have all landed."""
        ready = [x for x, i in self._live.items() if i.done is not None and i.inflight == 0]
        results = [self._result(x, self._live.pop(x)) for x in ready]
        for xfer_id in ready:
            self._forget(xfer_id, "finished")
        return results

    def _result(self, xfer_id: str, inbound: _Inbound) -> TransferResult:
        done = inbound.done
        assert done is not None
        problems = list(inbound.problems)
        if done.checksum_scheme != CHECKSUM_SCHEME:
            problems.append(
                f"sender checksums pages with {done.checksum_scheme!r}, this receiver with "
                f"{CHECKSUM_SCHEME!r}; run the same pdserve version on both ends"
            )
        for layer, (got, sent) in enumerate(zip(inbound.pages_per_layer, done.pages_per_layer)):
            if got != sent:
                problems.append(f"layer {layer}: received {got} pages, sender sent {sent}")
        if not problems and combine(inbound.digests) != done.checksum:
            problems.append("checksum of received pages does not match the sender's")
        return TransferResult(xfer_id, done.first, not problems, "; ".join(problems))

    def _lookup(self, xfer_id: str, what: str) -> _Inbound | None:
        inbound = self._live.get(xfer_id)
        if inbound is None:
            gone = self._gone.get(xfer_id)
            self.counters[f"{what}_{gone}_xfer" if gone else f"{what}_unknown_xfer"] += 1
        return inbound

    def _forget(self, xfer_id: str, how: str) -> None:
        self._gone[xfer_id] = how
        while len(self._gone) > _RECENT:
            self._gone.popitem(last=False)

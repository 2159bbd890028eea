"""One tensor-parallel rank's end of the KV data plane: on a decode node the rank's receiver,
on a prefill node its senders, each moving only the KV heads the rank holds.

A request's transfer between a prefill group at TP p and a decode group at TP d is one slice
per (prefill rank, decode rank) pair of `tp_map.transfer_plan`: slice `f"{xfer_id}.{i}"` goes
from prefill rank i to the decode rank that expects it, into that rank's share of the reserved
blocks. Every rank of a group holds a `RankKV`; rank 0 runs each method on its own and on every
worker's (`RankDriver.call`), so the node's KV code reads the same at any TP, and the decode
node admits a request only when every slice on every rank finished and verified.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.common.wire.payloads import FirstToken, KVLayout, TokenLogprobs
from pdserve.common.wire.security import load_keys
from pdserve.common.wire.tp_map import HeadSlice, transfer_plan
from pdserve.kv_transfer.base import KVReceiver
from pdserve.kv_transfer.port import KVPort

# A destination on the wire: the decode group's receiver endpoints, rank 0 first.
Endpoints = list[str]


def slice_id(xfer_id: str, src_rank: int) -> str:
    """The transfer id of prefill rank `src_rank`'s slice of transfer `xfer_id`."""
    return f"{xfer_id}.{src_rank}"


def encode_first(first: FirstToken) -> list[Any]:
    lp = first.logprobs
    lps = None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top], lp.rank]
    return [first.token_id, lps]


def decode_first(body: list[Any]) -> FirstToken:
    token, lps = body
    if lps is None:
        return FirstToken(token)
    tid, logprob, top, rank = lps
    return FirstToken(token, TokenLogprobs(tid, logprob, tuple(tuple(t) for t in top), rank))


class RankKV:
    """This rank's KV connector end (see the module docstring). Built on every rank of a node
    from the same options: `connector`, the checkpoint's `model_id` (the layout is the
    runner's, the model's whole KV heads), the directory of the cluster's CurveZMQ keys, and
    for a decode node the bind `host`/`port` (each rank binds its own: `port` + rank, or any
    free one when 0)."""

    COMMANDS = frozenset(
        {"endpoint", "expect", "cancel", "poll", "connect", "done", "abandon", "drop"}
    )

    def __init__(
        self,
        runner: Any,
        group: Any,
        connector: str,
        model_id: str,
        role: str,
        curve_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str = "127.0.0.1",
        connect_timeout: float = 10.0,
    ) -> None:
        self.caches: list[torch.Tensor] = runner.kv_caches
        self.rank, self.size = (0, 1) if group is None else (group.rank, group.size)
        self.layout: KVLayout = runner.kv_layout(model_id)
        keys = load_keys(curve_dir)
        self.port = KVPort(connector, self.layout, keys, connect_timeout, advertise_host)
        self.receiver: KVReceiver | None = None
        if role == "decode":
            self.receiver = self.port.listen(self.caches, host, port + self.rank if port else 0)
        self.failed: dict[str, str] = {}  # decode group (rank 0 endpoint) -> why sending broke

    def _plan(self, send_tp: int, recv_tp: int) -> tuple[HeadSlice, ...]:
        return transfer_plan(self.layout.num_kv_heads, send_tp, recv_tp)

    # -- decode side ----------------------------------------------------------------------------

    def endpoint(self) -> str:
        assert self.receiver is not None, "a decode node's rank binds a receiver"
        return self.receiver.endpoint

    def expect(self, xfer_id: str, block_ids: list[int], src_tp: int) -> list[str]:
        """Expect this rank's slices of `xfer_id` from a prefill group at TP `src_tp`; their
        transfer ids."""
        assert self.receiver is not None
        ids = []
        for s in self._plan(src_tp, self.size):
            if s.dst_rank == self.rank:
                heads = range(s.dst_offset, s.dst_offset + s.count)
                self.receiver.expect(slice_id(xfer_id, s.src_rank), block_ids, heads)
                ids.append(slice_id(xfer_id, s.src_rank))
        return ids

    def cancel(self, slice_ids: list[str]) -> None:
        assert self.receiver is not None
        for sid in slice_ids:
            self.receiver.cancel(sid)

    def poll(self) -> list[list[Any]]:
        """Slices finished here since the last poll: [slice id, ok, error, first token]."""
        assert self.receiver is not None
        return [[r.xfer_id, r.ok, r.error, encode_first(r.first)] for r in self.receiver.poll(0)]

    # -- prefill side ---------------------------------------------------------------------------

    def _my_slices(self, endpoints: Endpoints) -> list[HeadSlice]:
        return [s for s in self._plan(self.size, len(endpoints)) if s.src_rank == self.rank]

    def connect(self, endpoints: Endpoints, instance: str) -> None:
        """Handshake with every decode rank this rank sends to (raises what connect raises)."""
        for s in self._my_slices(endpoints):
            self.port.sender(endpoints[s.dst_rank], f"{instance}.{s.dst_rank}")

    def ship_layer(self, layer: int, shipments: list[list[Any]]) -> None:
        """Send this rank's slices of one layer's new pages: shipments are [endpoints,
        xfer_id, src blocks, dst blocks]; a broken connection goes to `failed`."""
        cache = self.caches[layer]
        for endpoints, xfer_id, src, dst in shipments:
            if endpoints[0] in self.failed:
                continue
            try:
                for s in self._my_slices(endpoints):
                    heads = range(s.src_offset, s.src_offset + s.count)
                    sender = self.port.senders[endpoints[s.dst_rank]]
                    sender.send_layer(slice_id(xfer_id, self.rank), layer, src, dst, cache, heads)
            except (RuntimeError, OSError, KeyError) as exc:
                self.failed[endpoints[0]] = str(exc)

    def take_failures(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed

    def done(self, endpoints: Endpoints, xfer_id: str, first: list[Any]) -> None:
        """End this rank's slices of `xfer_id` with the request's first token."""
        for s in self._my_slices(endpoints):
            sender = self.port.senders[endpoints[s.dst_rank]]
            sender.send_done(slice_id(xfer_id, self.rank), decode_first(first))

    def abandon(self, endpoints: Endpoints, xfer_id: str) -> None:
        for s in self._my_slices(endpoints):
            sender = self.port.senders.get(endpoints[s.dst_rank])
            if sender is not None:
                sender.abandon(slice_id(xfer_id, self.rank))

    def drop(self, endpoints: Endpoints) -> None:
        for endpoint in endpoints:
            self.port.drop(endpoint)

    def close(self) -> None:
        self.port.close()

"""KV from a prefill group at TP p to a decode group at TP d, on every connector that carries
KV-head slices: each decode rank receives exactly the heads it holds, from the prefill ranks
the plan names (`common.wire.payloads`), and the decode group's caches, joined across ranks, are
bit-identical to the prefill group's. The prefill ranks' caches and senders live in a child
process, the decode ranks' receivers here."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import torch

from pdserve.common.wire.payloads import rank_kv_heads, transfer_plan
from pdserve.kv_transfer import KVLayout, KVReceiver, create_receiver
from tests.kv_transfer.helpers import Pump, SenderProcess, make_caches, needs_nixl

SRC_BLOCKS, DST_BLOCKS = 12, 16
SEED = 77
# (KV heads, prefill TP, decode TP): the pairs, and KV heads replicated (4 ranks, 2 heads).
PAIRS = [(4, 1, 1), (4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 1, 4), (4, 4, 1), (2, 4, 4), (2, 4, 1)]


def layout(kv_heads: int) -> KVLayout:
    return KVLayout(
        "tiny", "float32", num_layers=2, num_kv_heads=kv_heads, head_dim=8, block_size=4
    )


@pytest.fixture(
    scope="module", params=["zmq", "nccl", "shm", pytest.param("nixl", marks=needs_nixl)]
)
def connector(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def child() -> Iterator[SenderProcess]:
    proc = SenderProcess()
    try:
        yield proc
    finally:
        proc.close()


class Groups:
    """p prefill ranks (caches and senders in the child) and d decode ranks (receivers here)."""

    def __init__(self, connector: str, child: SenderProcess, kv: int, p: int, d: int) -> None:
        self.layout, self.child, self.kv, self.p, self.d = layout(kv), child, kv, p, d
        # The child keeps every group's caches: a freed cache's memory stays registered with
        # its NIXL agent (a node's caches live as long as it does), so none is reused.
        self.tag = uuid.uuid4().hex[:8]
        self.full = make_caches(self.layout, SRC_BLOCKS, SEED)
        self.caches: list[list[torch.Tensor]] = []
        self.receivers: list[KVReceiver] = []
        for j in range(d):
            heads = len(rank_kv_heads(kv, d, j))
            shape = (2, DST_BLOCKS, 4, heads, 8)
            self.caches.append([torch.zeros(shape) for _ in range(self.layout.num_layers)])
            self.receivers.append(create_receiver(connector, self.layout, self.caches[j]))
        self.pump = Pump(*self.receivers)
        self.plan = transfer_plan(kv, p, d)
        self.senders: list[str] = []
        for i in range(p):
            held = rank_kv_heads(kv, p, i)
            self._call(
                op="cache",
                name=f"{self.tag}p{i}",
                layout=self.layout.to_dict(),
                num_blocks=SRC_BLOCKS,
                seed=SEED,
                heads=[held.start, held.stop],
            )
        for s in self.plan:
            name = f"s{s.src_rank}-{s.dst_rank}"
            self._call(
                op="sender",
                name=name,
                connector=connector,
                layout=self.layout.to_dict(),
                endpoint=self.receivers[s.dst_rank].endpoint,
                timeout=30.0,  # the connect's, in the child (a handshake under load)
            )
            self.senders.append(name)

    def _call(self, **cmd) -> None:
        reply = self.child.call(self.pump, **cmd)
        assert reply["ok"], reply

    def transfer(self, xfer: str, src: list[int], dst: list[int]) -> list[str]:
        """Every slice of one request's transfer: expected, sent layer by layer, done."""
        ids = []
        for s in self.plan:
            xfer_id = f"{xfer}.{s.src_rank}-{s.dst_rank}"  # unique across receivers too
            heads = range(s.dst_offset, s.dst_offset + s.count)
            self.receivers[s.dst_rank].expect(xfer_id, dst, heads)
            name = f"s{s.src_rank}-{s.dst_rank}"
            self._call(
                op="send",
                sender=name,
                cache=f"{self.tag}p{s.src_rank}",
                xfer=xfer_id,
                layers=[0, 1],
                src=src,
                dst=dst,
                heads=[s.src_offset, s.src_offset + s.count],
            )
            self._call(op="done", sender=name, xfer=xfer_id, token=5, logprob=None)
            self._call(op="flush", sender=name)
            ids.append((s.dst_rank, xfer_id))
        return ids

    def close(self) -> None:
        for name in self.senders:
            self._call(op="close", sender=name)
        for r in self.receivers:
            r.close()


@pytest.mark.parametrize(("kv", "p", "d"), PAIRS)
def test_decode_group_holds_the_prefill_groups_kv_bit_for_bit(connector, child, kv, p, d) -> None:
    groups = Groups(connector, child, kv, p, d)
    try:
        rng = random.Random(p * 10 + d)
        src, dst = rng.sample(range(SRC_BLOCKS), 5), rng.sample(range(DST_BLOCKS), 5)
        check_arrived(groups, "req", src, dst)
    finally:
        groups.close()


def check_arrived(groups: Groups, xfer: str, src: list[int], dst: list[int]) -> None:
    """Transfer `src` into `dst`: every slice ok, and each decode rank's caches hold exactly its
    heads of the prefill group's pages there (zeros elsewhere)."""
    ids = groups.transfer(xfer, src, dst)
    results = groups.pump.wait_results(*(x for _, x in ids))
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(r.first.token_id == 5 for r in results)
    for layer, full in enumerate(groups.full):
        for j, caches in enumerate(groups.caches):
            held = rank_kv_heads(groups.kv, groups.d, j)
            expected = torch.zeros_like(caches[layer])
            expected[:, dst] = full[:, src][:, :, :, held.start : held.stop]
            assert torch.equal(caches[layer], expected), (layer, j)


@pytest.mark.parametrize(("kv", "p", "d"), [(4, 2, 1), (4, 1, 2)])
def test_an_aborted_transfer_is_released_on_every_rank_then_refilled(connector, child, kv, p, d):
    """An abort after layer 0: every decode rank cancels its slices. A fencing connector
    (nixl) names every slice released once its sender settled (the decode node frees the
    blocks only then); the blocks then take a new transfer, which arrives whole."""
    groups = Groups(connector, child, kv, p, d)
    try:
        src, dst = [1, 2, 3], [4, 5, 6]
        gone = {}
        for s in groups.plan:
            xfer_id, name = f"gone.{s.src_rank}-{s.dst_rank}", f"s{s.src_rank}-{s.dst_rank}"
            groups.receivers[s.dst_rank].expect(
                xfer_id, dst, range(s.dst_offset, s.dst_offset + s.count)
            )
            cache, heads = f"{groups.tag}p{s.src_rank}", [s.src_offset, s.src_offset + s.count]
            groups._call(
                op="send",
                sender=name,
                cache=cache,
                xfer=xfer_id,
                layers=[0],
                src=src,
                dst=dst,
                heads=heads,
            )
            gone[xfer_id] = (s.dst_rank, name)
        # Layer 0 in on every rank first (nixl: its WRITEs are done at flush), so the cancel
        # meets written blocks (late frames of a cancelled slice: the test below).
        for _, name in gone.values():
            groups._call(op="flush", sender=name)
        landed = [len(src) * sum(s.dst_rank == j for s in groups.plan) for j in range(d)]
        if not groups.receivers[0].fences:
            groups.pump.until(lambda: [r.pages_received for r in groups.receivers] == landed)
        for xfer_id, (j, _) in gone.items():
            groups.receivers[j].cancel(xfer_id)
        fenced = set(gone) if groups.receivers[0].fences else set()
        for j, name in gone.values():  # each sender takes its receiver's cancels and settles
            told = sorted(x for x in fenced if gone[x][0] == j)  # a fence waits for every peer
            groups._call(op="poll", sender=name, cancelled=told)
        released: set[str] = set()
        groups.pump.until(
            lambda: (
                released.update(x for r in groups.receivers for x in r.released())
                or released == fenced
            ),
            what=f"released {sorted(fenced)}",
        )
        for caches in groups.caches:  # layer 0 may have landed before the cancel: start clean
            for cache in caches:
                cache.zero_()
        check_arrived(groups, "again", src, dst)
    finally:
        groups.close()


def test_a_corrupted_slice_fails_only_its_own_transfer(connector, child) -> None:
    groups = Groups(connector, child, 4, 2, 1)
    try:
        groups._call(op="close", sender="s1-0")  # the sender of rank 1 again, now corrupting
        groups._call(
            op="sender",
            name="s1-0",
            connector=connector,
            layout=groups.layout.to_dict(),
            endpoint=groups.receivers[0].endpoint,
            timeout=30.0,  # the connect's, in the child (a handshake under load)
            corrupt="req.1-0",
        )
        ids = groups.transfer("req", [1, 2], [3, 4])
        ok = {x: r.ok for (_, x), r in zip(ids, groups.pump.wait_results(*(x for _, x in ids)))}
        assert ok == {"req.0-0": True, "req.1-0": False}
    finally:
        groups.close()


def test_heads_outside_the_cache_are_refused(connector) -> None:
    caches = [torch.zeros(2, 4, 4, 2, 8) for _ in range(2)]
    receiver = create_receiver(connector, layout(4), caches)
    try:
        with pytest.raises(ValueError, match="not a range within"):
            receiver.expect("x", [1], range(1, 3))
    finally:
        receiver.close()


@pytest.mark.parametrize("connector", ["zmq", "nccl", "shm"])
def test_a_late_slice_of_a_cancelled_transfer_keeps_its_sender(connector, child) -> None:
    """Frames of a head slice that arrive after its transfer was cancelled (an abort racing
    the sender) are refused as late, not as malformed: the sender stays connected and its
    next transfer arrives whole."""
    groups = Groups(connector, child, 4, 2, 1)
    try:
        receiver = groups.receivers[0]
        for s in groups.plan:
            xfer_id = f"gone.{s.src_rank}-{s.dst_rank}"
            receiver.expect(xfer_id, [4, 5], range(s.dst_offset, s.dst_offset + s.count))
            receiver.cancel(xfer_id)  # before any frame of it is sent
            name = f"s{s.src_rank}-{s.dst_rank}"
            heads = [s.src_offset, s.src_offset + s.count]
            groups._call(
                op="send", sender=name, cache=f"{groups.tag}p{s.src_rank}", xfer=xfer_id,
                layers=[0], src=[1, 2], dst=[4, 5], heads=heads,
            )  # fmt: skip
            groups._call(op="flush", sender=name)
        late = len(groups.plan)
        groups.pump.until(lambda: receiver.counters.get("frame_cancelled_xfer", 0) == late)
        assert receiver.counters.get("bad_header", 0) == 0, receiver.counters
        check_arrived(groups, "again", [1, 2], [4, 5])
    finally:
        groups.close()

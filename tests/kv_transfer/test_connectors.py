"""Every connector across real processes: the sender lives in a child, the receiver here.

nixl runs when its extra is installed (CI installs it). Its sender writes into the receiver's
memory itself, so where the others count refused frames at the receiver, nixl's sender
refuses to write (blocks outside the announced reservation, a cancelled transfer) and the
receiver fences a cancelled transfer's blocks until the sender settled."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from pdserve.common.wire.payloads import FirstToken, TokenLogprobs
from pdserve.kv_transfer import KVLayout, KVReceiver, create_receiver
from tests.kv_transfer.helpers import Pump, SenderProcess, make_caches, needs_nixl

LAYOUT = KVLayout("tiny-llama", "float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
SRC_BLOCKS, DST_BLOCKS = 20, 24
SENDER_SEED = 1234
# A small shm ring (3 pages) forces frames to be split, the ring to wrap and credits to flow.
RECEIVER_OPTS: dict[str, dict[str, Any]] = {"shm": {"staging_bytes": 3 * LAYOUT.page_bytes}}
SENDER_OPTS: dict[str, dict[str, Any]] = {"nixl": {"announce_timeout": 1.0}}


NIXL = pytest.param("nixl", marks=needs_nixl)


@pytest.fixture(scope="module", params=["zmq", "nccl", "shm", NIXL])
def connector(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def child(connector: str) -> Iterator[SenderProcess]:
    proc = SenderProcess()
    try:
        yield proc
    finally:
        proc.close()


class Setup:
    """A receiver here, a connected sender (named "s") and its caches in the child."""

    def __init__(self, connector: str, child: SenderProcess, layout: KVLayout) -> None:
        self.connector, self.child, self.layout = connector, child, layout
        self.caches = make_caches(layout, DST_BLOCKS, seed=99)
        self.receiver: KVReceiver = create_receiver(
            connector, layout, self.caches, **RECEIVER_OPTS.get(connector, {})
        )
        self.pump = Pump(self.receiver)
        self.before = [c.clone() for c in self.caches]
        self.sent = make_caches(layout, SRC_BLOCKS, SENDER_SEED)
        try:
            cache = dict(name="c", layout=layout.to_dict(), num_blocks=SRC_BLOCKS, seed=SENDER_SEED)
            child.ok(None, op="cache", **cache)
            reply = self.connect("s")
            assert reply["ok"], reply
        except BaseException:
            self.receiver.close()
            raise

    def connect(self, name: str, layout: KVLayout | None = None, **extra: Any) -> dict[str, Any]:
        layout = layout or self.layout
        return self.child.call(
            self.pump,
            op="sender",
            name=name,
            connector=self.connector,
            layout=layout.to_dict(),
            endpoint=self.receiver.endpoint,
            timeout=30.0,  # the connect's, in the child (a handshake under load)
            opts=SENDER_OPTS.get(self.connector, {}),
            **extra,
        )

    def send(
        self,
        xfer: str,
        src: list[int],
        dst: list[int],
        layers: list[int] | None = None,
        sender: str = "s",
    ) -> None:
        layers = list(range(self.layout.num_layers)) if layers is None else layers
        self.child.ok(
            self.pump,
            op="send",
            sender=sender,
            cache="c",
            xfer=xfer,
            layers=layers,
            src=src,
            dst=dst,
        )

    def done(
        self, xfer: str, sender: str = "s", token: int = 0, logprob: float | None = None
    ) -> None:
        self.child.ok(self.pump, op="done", sender=sender, xfer=xfer, token=token, logprob=logprob)
        self.child.ok(self.pump, op="flush", sender=sender)

    def check_blocks(self, written: dict[int, int], layers: list[int] | None = None) -> None:
        """Blocks in `written` (dst -> src) hold the sender's pages in `layers`; every other
        block of every layer is as it was."""
        layers = list(range(self.layout.num_layers)) if layers is None else layers
        for layer, cache in enumerate(self.caches):
            expected = self.before[layer].clone()
            if layer in layers:
                for dst, src in written.items():
                    expected[:, dst] = self.sent[layer][:, src]
            assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8)), layer

    def frames(self, n_blocks: int) -> int:
        """Frames one layer of `n_blocks` takes (a small shm ring splits them)."""
        staging = RECEIVER_OPTS.get(self.connector, {}).get("staging_bytes")
        per_frame = staging // self.layout.page_bytes if staging else n_blocks
        return -(-n_blocks // per_frame)

    def close(self) -> None:
        self.child.ok(self.pump, op="close", sender="s")
        self.receiver.close()


@pytest.fixture
def setup(connector: str, child: SenderProcess) -> Iterator[Setup]:
    s = Setup(connector, child, LAYOUT)
    try:
        yield s
    finally:
        s.close()


def blocks(seed: int, n: int) -> tuple[list[int], list[int]]:
    """Random non-contiguous source and destination block ids."""
    rng = random.Random(seed)
    return rng.sample(range(SRC_BLOCKS), n), rng.sample(range(DST_BLOCKS), n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_by_layer_transfer_is_bit_exact(
    connector: str, child: SenderProcess, dtype: str
) -> None:
    s = Setup(connector, child, replace(LAYOUT, dtype=dtype))
    try:
        src, dst = blocks(1, 7)
        s.receiver.expect("x1", dst)
        s.send("x1", src, dst)
        s.done("x1", token=42, logprob=-0.5)
        (result,) = s.pump.wait_results("x1")
        assert result.ok, result.error
        assert result.first == FirstToken(42, TokenLogprobs(42, -0.5, ((42, -0.5),), 1))
        s.check_blocks(dict(zip(dst, src)))
        assert not s.receiver.counters
        assert s.receiver.pages_received == 7 * LAYOUT.num_layers
    finally:
        s.close()


def test_two_transfers_interleaved(setup: Setup) -> None:
    src_a, dst_a = blocks(2, 5)
    src_b = [b for b in range(SRC_BLOCKS) if b not in src_a][:6]
    dst_b = [b for b in range(DST_BLOCKS) if b not in dst_a][::-1][:6]
    setup.receiver.expect("a", dst_a)
    setup.receiver.expect("b", dst_b)
    for layer in range(LAYOUT.num_layers):
        setup.send("a", src_a, dst_a, [layer])
        setup.send("b", src_b, dst_b, [layer])
    setup.done("b", token=2)
    setup.done("a", token=1)
    a, b = setup.pump.wait_results("a", "b")
    assert a.ok and b.ok, (a.error, b.error)
    assert (a.first, b.first) == (FirstToken(1), FirstToken(2))
    setup.check_blocks({**dict(zip(dst_a, src_a)), **dict(zip(dst_b, src_b))})


@pytest.mark.parametrize(
    "field, value",
    [("dtype", "bfloat16"), ("block_size", 8), ("model_id", "other-model")],
)
def test_layout_mismatch_is_refused_at_handshake(setup: Setup, field: str, value: Any) -> None:
    reply = setup.connect("bad", replace(LAYOUT, **{field: value}))
    assert not reply["ok"] and reply["error"] == "LayoutMismatchError", reply
    message = reply["message"]
    assert field in message and repr(value) in message and repr(getattr(LAYOUT, field)) in message
    assert setup.receiver.counters == {"refused_layout": 1}


def test_unexpected_xfer_is_refused_and_counted(setup: Setup) -> None:
    src, dst = blocks(3, 4)
    setup.send("ghost", src, dst)
    setup.done("ghost")
    setup.pump.until(lambda: setup.receiver.counters.get("done_unknown_xfer") == 1)
    # nixl's sender writes nothing the receiver did not announce: no frames to refuse.
    frames = 0 if setup.connector == "nixl" else LAYOUT.num_layers * setup.frames(4)
    assert setup.receiver.counters == {
        **({"frame_unknown_xfer": frames} if frames else {}),
        "done_unknown_xfer": 1,
    }
    assert not setup.pump.results
    setup.check_blocks({})


def test_blocks_outside_the_reservation_are_refused(setup: Setup) -> None:
    src, dst = blocks(4, 3)  # three blocks: one frame per layer on every connector
    setup.receiver.expect("y", dst[:2])
    setup.send("y", src, dst)
    setup.done("y")
    (result,) = setup.pump.wait_results("y")
    if setup.connector == "nixl":  # the sender refuses to write them, and says so
        assert not result.ok and "outside the reservation" in result.error
        assert setup.receiver.counters == {}
    else:
        assert not result.ok and "refused blocks" in result.error
        # A frame with one block outside is refused whole, blocks inside included.
        assert setup.receiver.counters == {"block_outside_reservation": LAYOUT.num_layers}
    setup.check_blocks({})


def test_corrupted_page_fails_the_checksum(setup: Setup) -> None:
    reply = setup.connect("faulty", corrupt="bad")
    assert reply["ok"], reply
    src, dst = blocks(5, 3)
    setup.receiver.expect("bad", dst[:2])
    setup.receiver.expect("good", dst[2:])
    setup.send("bad", src[:2], dst[:2], sender="faulty")
    setup.send("good", src[2:], dst[2:], sender="faulty")
    setup.done("bad", sender="faulty")
    setup.done("good", sender="faulty")
    bad, good = setup.pump.wait_results("bad", "good")
    setup.child.ok(setup.pump, op="close", sender="faulty")
    assert not bad.ok and "checksum" in bad.error
    assert good.ok, good.error


def test_cancel_drops_late_frames(setup: Setup) -> None:
    src, dst = blocks(6, 5)
    setup.receiver.expect("c", dst)
    setup.send("c", src, dst, [0])
    written = dict(zip(dst, src))

    def first_layer_landed() -> bool:
        return all(
            torch.equal(setup.caches[0][:, d], setup.sent[0][:, s]) for d, s in written.items()
        )

    setup.pump.until(first_layer_landed, what="layer 0")
    setup.receiver.cancel("c")
    if setup.connector == "nixl":
        # The blocks stay fenced until the sender takes the cancel and settles; it then
        # writes nothing more of the transfer, and sends no done.
        released: list[str] = []
        setup.pump.once()
        assert setup.receiver.released() == []
        setup.send("c", src, dst, list(range(1, LAYOUT.num_layers)))
        setup.done("c")
        setup.pump.until(lambda: released.extend(setup.receiver.released()) or released)
        # (layer 0's notification may come after the cancel: counted as late, no more)
        assert released == ["c"] and set(setup.receiver.counters) <= {"late_notification"}
        setup.check_blocks(written, layers=[0])
        return
    setup.send("c", src, dst, list(range(1, LAYOUT.num_layers)))
    setup.done("c")
    setup.pump.until(lambda: setup.receiver.counters.get("done_cancelled_xfer") == 1)
    assert setup.receiver.counters == {
        "frame_cancelled_xfer": (LAYOUT.num_layers - 1) * setup.frames(5),
        "done_cancelled_xfer": 1,
    }
    assert "c" not in setup.pump.results
    setup.check_blocks(written, layers=[0])


@pytest.mark.parametrize("connector", [NIXL])
def test_nixl_fence_lifts_after_a_silent_sender_times_out(connector: str) -> None:
    """A sender that never answers a cancel: its blocks are released after fence_timeout,
    the sender is dropped (it must handshake again), and when it wakes it still writes
    nothing of the cancelled transfer (it reads the cancel before any WRITE)."""
    RECEIVER_OPTS["nixl"] = {"fence_timeout": 0.5}
    child = SenderProcess()
    try:
        s = Setup(connector, child, LAYOUT)
    except BaseException:
        child.close()
        raise
    finally:
        RECEIVER_OPTS.pop("nixl")
    try:
        src, dst = blocks(7, 4)
        s.receiver.expect("f", dst)
        s.child.ok(s.pump, op="poll", sender="s")  # the announcement reached the sender
        s.receiver.cancel("f")
        released: list[str] = []
        s.pump.until(lambda: released.extend(s.receiver.released()) or released)
        assert released == ["f"] and s.receiver.counters == {"fence_timeout": 1}
        s.send("f", src, dst)  # late: the sender reads the cancel first
        s.check_blocks({})
    finally:
        s.close()
        child.close()

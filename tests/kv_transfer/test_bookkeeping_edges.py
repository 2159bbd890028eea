"""Transfer bookkeeping edges that mutation testing showed no test pinned
(scripts/mutation.sh): every refusal counted under its own name, what a failed transfer says,
frames still in flight, and how many ended transfers a receiver remembers."""

from __future__ import annotations

import pytest

from pdserve.common.wire.payloads import FirstToken
from pdserve.kv_transfer.channel import SendBook
from pdserve.kv_transfer.channel_receiver import ReceiveBook
from pdserve.kv_transfer.wire import KVPage


def page(xfer: str, layer: int, blocks: tuple[int, ...]) -> KVPage:
    return KVPage(xfer, layer, blocks, "float32", (2, len(blocks), 1, 1, 1), seq=0)


def send(sent: SendBook, got: ReceiveBook, p: KVPage, checksum: int = 11) -> None:
    sent.record(p, checksum)
    assert got.admit(p)
    assert got.land(p, checksum)


def test_every_refusal_is_counted_under_its_own_name() -> None:
    got = ReceiveBook(1)
    for xfer in ("cancelled", "finished"):
        got.expect(xfer, [1])
    got.cancel("cancelled")
    got.on_done(SendBook(1).close("finished", FirstToken(0)))
    assert [r.xfer_id for r in got.finished()] == ["finished"]
    for _ in range(2):
        for xfer in ("never", "cancelled", "finished"):
            assert not got.admit(page(xfer, 0, (1,)))
        got.on_done(SendBook(1).close("never", FirstToken(0)))
    assert got.counters == {
        "frame_unknown_xfer": 2,
        "frame_cancelled_xfer": 2,
        "frame_finished_xfer": 2,
        "done_unknown_xfer": 2,
    }


def test_frames_after_done_and_outside_the_reservation_are_refused() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    got.expect("t", [1, 2])
    outside = tuple(range(10, 19))
    for _ in range(2):
        assert not got.admit(page("t", 0, (1, *outside)))
    got.on_done(sent.close("t", FirstToken(0)))
    for _ in range(2):
        assert not got.admit(page("t", 0, (1,)))
    assert got.counters == {"block_outside_reservation": 2, "frame_after_done": 2}
    (result,) = got.finished()
    refused = "layer 0: refused blocks [10, 11, 12, 13, 14, 15, 16, 17]"
    assert result.xfer_id == "t" and not result.ok
    assert result.error == f"{refused}; {refused}"


def test_a_transfer_waits_for_every_frame_in_flight() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    got.expect("t", [1, 2])
    first, second = page("t", 0, (1,)), page("t", 0, (2,))
    for p in (first, second):
        sent.record(p, 5)
        assert got.admit(p)
    got.on_done(sent.close("t", FirstToken(0)))
    assert got.land(first, 5) and got.finished() == []
    assert got.land(second, 5)
    (result,) = got.finished()
    assert result.ok and got.pages_received == 2


def test_pages_received_counts_every_block_written() -> None:
    sent, got = SendBook(2), ReceiveBook(2)
    got.expect("t", [1, 2, 3])
    send(sent, got, page("t", 0, (1, 2)))
    send(sent, got, page("t", 1, (1, 2, 3)))
    assert got.pages_received == 5


def test_a_late_frame_is_counted_each_time() -> None:
    got = ReceiveBook(1)
    got.expect("t", [1])
    p = page("t", 0, (1,))
    assert got.admit(p) and got.admit(p)
    got.cancel("t")
    assert not got.land(p, 1) and not got.land(p, 1)
    assert got.counters == {"late_frame": 2}


def test_a_second_done_or_one_with_the_wrong_layers_is_refused() -> None:
    got = ReceiveBook(2)
    got.expect("t", [1])
    got.on_done(SendBook(1).close("t", FirstToken(0)))  # one layer, not two
    assert got.counters == {"bad_done": 1} and got.finished() == []
    got.on_done(SendBook(2).close("t", FirstToken(0)))
    got.on_done(SendBook(2).close("t", FirstToken(0)))
    assert got.counters == {"bad_done": 2}
    (result,) = got.finished()
    assert result.ok


def test_a_checksum_that_differs_fails_the_transfer_and_says_so() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    got.expect("t", [1])
    p = page("t", 0, (1,))
    sent.record(p, 11)
    assert got.admit(p) and got.land(p, 12)
    got.on_done(sent.close("t", FirstToken(0)))
    (result,) = got.finished()
    assert not result.ok
    assert result.error == "checksum of received pages does not match the sender's"


def test_an_empty_transfer_reports_no_pages() -> None:
    done = SendBook(3).close("t", FirstToken(0))
    assert done.pages_per_layer == (0, 0, 0)


def test_expecting_twice_and_cancelling_an_unknown_transfer() -> None:
    got = ReceiveBook(1)
    got.cancel("never")  # a no-op
    got.expect("t", [1])
    with pytest.raises(ValueError, match="^transfer 't' is already expected$"):
        got.expect("t", [1])


def test_the_receiver_remembers_the_last_4096_ended_transfers() -> None:
    got = ReceiveBook(1)
    for i in range(4097):
        got.expect(f"x{i}", [1])
        got.cancel(f"x{i}")
    got.admit(page("x0", 0, (1,)))  # the oldest is forgotten
    assert got.counters == {"frame_unknown_xfer": 1}
    for i in (1, 4096):
        got.admit(page(f"x{i}", 0, (1,)))
    assert got.counters == {"frame_unknown_xfer": 1, "frame_cancelled_xfer": 2}


def test_a_frame_that_failed_fails_its_transfer_once_the_others_landed() -> None:
    sent, got = SendBook(1), ReceiveBook(1)
    got.expect("t", [1, 2])
    assert got.is_live("t") and not got.is_live("u")
    bad, good = page("t", 0, (1,)), page("t", 0, (2,))
    for p in (bad, good):
        sent.record(p, 5)
        assert got.admit(p)
    got.on_done(sent.close("t", FirstToken(0)))
    got.fail(bad, "short read")
    got.fail(page("u", 0, (1,)), "no such transfer")  # counted, nothing else to do
    assert got.finished() == [] and got.counters == {"bad_frame": 2}
    assert got.land(good, 5)
    (result,) = got.finished()
    assert not result.ok
    assert result.error == "layer 0: short read; layer 0: received 1 pages, sender sent 2"
    assert not got.is_live("t")

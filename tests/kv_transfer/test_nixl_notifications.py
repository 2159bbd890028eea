"""NIXL notifications of a process's one agent, shared by every receiver in it: one reader
copies each into every receiver's inbox (NIXL gives a notification to its first reader only,
so a receiver reading for itself took the others'), and a receiver counts as late only the
notifications of its own finished or cancelled transfers."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator

import msgpack
import pytest
import torch

from pdserve.kv_transfer import KVLayout, create_receiver
from pdserve.kv_transfer.nixl_agent import Inbox, Notifications
from tests.kv_transfer.helpers import needs_nixl


class FakeNixl:
    """An agent whose notifications are what the test queued, read at most once each."""

    errors = (RuntimeError,)

    def __init__(self) -> None:
        self.agent = self
        self.queued: deque[bytes] = deque()
        self._lock = threading.Lock()

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            got, self.queued = list(self.queued), deque()
        return {"peer-agent": got} if got else {}


def wait_for(inbox: Inbox, n: int, timeout: float = 10.0) -> list[bytes]:
    """The inbox's next n notifications (AssertionError if they do not come in time)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} notifications came"
        got += inbox.take()
        time.sleep(0.001)
    return got


def test_every_inbox_gets_every_notification_once() -> None:
    fake = FakeNixl()
    notes = Notifications(fake)  # type: ignore[arg-type]
    first, second = notes.subscribe(), notes.subscribe()
    try:
        fake.queued.extend([b"a", b"b", b"c"])
        assert wait_for(first, 3) == [b"a", b"b", b"c"]
        assert wait_for(second, 3) == [b"a", b"b", b"c"]
        notes.unsubscribe(first)
        fake.queued.append(b"d")
        assert wait_for(second, 1) == [b"d"]
        assert first.take() == []  # unsubscribed: nothing more
    finally:
        notes.unsubscribe(first)
        notes.unsubscribe(second)


def test_the_reader_stops_with_the_last_inbox_and_starts_with_a_new_one() -> None:
    fake = FakeNixl()
    notes = Notifications(fake)  # type: ignore[arg-type]
    before = set(threading.enumerate())
    inbox = notes.subscribe()
    (reader,) = [t for t in set(threading.enumerate()) - before if t.name == "nixl-progress"]
    notes.unsubscribe(inbox)
    assert not reader.is_alive()
    again = notes.subscribe()
    try:
        fake.queued.append(b"x")
        assert wait_for(again, 1) == [b"x"]
    finally:
        notes.unsubscribe(again)


@pytest.fixture()
def two_receivers() -> Iterator[list]:
    layout = KVLayout("tiny", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    receivers = []
    try:
        for _ in range(2):
            caches = [torch.zeros(2, 8, 4, 2, 8) for _ in range(layout.num_layers)]
            receivers.append(create_receiver("nixl", layout, caches))
        yield receivers
    finally:
        for r in receivers:
            r.close()


@needs_nixl
def test_a_receiver_takes_its_own_notifications_and_ignores_its_neighbours(two_receivers):
    """Receivers of one process see each other's notifications (one reader copies them to
    both): each lands its own, counts its own finished ones as late, and ignores the rest."""
    mine, neighbour = two_receivers
    assert mine._agent.notifications is neighbour._agent.notifications
    mine.expect("a", [1, 2])
    neighbour.expect("b", [3])
    landed = msgpack.packb(["a", 0, [1, 2]])
    for r in two_receivers:  # what the shared reader does with one notification
        r._inbox.got.append(landed)
        r.poll(0)
    assert mine.pages_received == 2 and "late_notification" not in mine.counters
    assert neighbour.pages_received == 0 and not neighbour.counters, neighbour.counters
    mine.cancel("a")  # no sender connected: released at once
    for r in two_receivers:
        r._inbox.got.append(msgpack.packb(["a", 1, [1, 2]]))
        r.poll(0)
    assert mine.counters["late_notification"] == 1 and mine.pages_received == 2
    assert not neighbour.counters, neighbour.counters

"""Receiver and sender guards, in one process with raw sockets where a real sender would not
misbehave: handshakes, malformed frames, frame sizes, timeouts, argument checks."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest
import torch
import zmq

from pdserve.common.wire.messages import encode
from pdserve.common.wire.payloads import FirstToken
from pdserve.kv_transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    TransferError,
    TransferTimeout,
    create_receiver,
    create_sender,
)
from pdserve.kv_transfer.wire import (
    CHECKSUM_SCHEME,
    KV_PLANE,
    KVDone,
    KVHello,
    KVPage,
    KVWelcome,
)
from pdserve.testbed.kvfaults import FaultPlan, PlannedFaults
from tests.kv_transfer.helpers import Pump, make_caches

LAYOUT = KVLayout("tiny", "float32", num_layers=2, num_kv_heads=1, head_dim=4, block_size=2)


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    recv = create_receiver("zmq", LAYOUT, make_caches(LAYOUT, 8, seed=0))
    try:
        yield recv
    finally:
        recv.close()


@pytest.fixture
def raw() -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        yield sock
    finally:
        sock.close()


def handshake(sock: zmq.Socket, receiver: KVReceiver) -> None:
    sock.connect(receiver.endpoint)
    sock.send(encode(KVHello("raw", "zmq", LAYOUT.digest(), LAYOUT)))
    Pump(receiver).until(lambda: sock.poll(0) != 0, timeout=5.0, what="welcome")
    welcome = KV_PLANE.decode(sock.recv())
    assert isinstance(welcome, KVWelcome) and welcome.extra == {"checksum": CHECKSUM_SCHEME}


def connect_while_polling(sender: KVSender, receiver: KVReceiver, timeout: float = 5.0) -> None:
    """connect() needs the receiver polled; in one process a thread polls during the call."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            receiver.poll(0.01)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        sender.connect(receiver.endpoint, timeout)
    finally:
        stop.set()
        thread.join(timeout=5.0)


def test_frames_without_handshake_or_garbage_are_counted(receiver, raw) -> None:
    raw.connect(receiver.endpoint)
    raw.send_multipart([encode(KVPage("x", 0, (1,), "float32", (2, 1, 2, 1, 4), 0)), b"\0" * 64])
    raw.send(b"\xc1 not msgpack")
    pump = Pump(receiver)
    pump.until(lambda: sum(receiver.counters.values()) == 2, timeout=5.0)
    assert receiver.counters == {"no_handshake": 1, "malformed": 1}


def test_a_hello_with_a_malformed_layout_pairs_no_sender(receiver, raw) -> None:
    raw.connect(receiver.endpoint)
    body = {"model_id": "m", "dtype": "float32", "num_layers": 2}  # geometry missing
    raw.send(encode(KVHello("raw", "zmq", LAYOUT.digest(), body)))  # type: ignore[arg-type]
    page = KVPage("x", 0, (1,), "float32", (2, 1, 2, 1, 4), 0)
    raw.send_multipart([encode(page), b"\0" * 64])  # so no peer was taken
    Pump(receiver).until(lambda: sum(receiver.counters.values()) == 2, timeout=5.0)
    assert receiver.counters == {"malformed": 1, "no_handshake": 1}
    assert raw.poll(0) == 0  # nothing answered: a frame that is no message gets no reply


def test_frame_of_wrong_byte_length_is_not_written(receiver, raw) -> None:
    handshake(raw, receiver)
    before = [c.clone() for c in receiver.kv_caches]
    receiver.expect("x", [1, 3])
    header = KVPage("x", 0, (1, 3), "float32", (2, 2, 2, 1, 4), seq=0)
    raw.send_multipart([encode(header), b"\0" * 120])  # 128 bytes expected
    raw.send(encode(KVDone("x", FirstToken(0), 0, (2, 0), CHECKSUM_SCHEME)))
    (result,) = Pump(receiver).wait_results("x", timeout=5.0)
    assert not result.ok and "expected one of 128" in result.error
    assert receiver.counters == {"bad_frame": 1}
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.kv_caches))


def test_header_that_contradicts_the_layout_drops_the_sender(receiver, raw) -> None:
    handshake(raw, receiver)
    receiver.expect("x", [1])
    raw.send_multipart([encode(KVPage("x", 0, (1,), "float16", (2, 1, 2, 1, 4), 0)), b"\0" * 32])
    raw.send(encode(KVDone("x", FirstToken(0), 0, (0, 0), CHECKSUM_SCHEME)))
    Pump(receiver).until(lambda: receiver.counters.get("no_handshake") == 1, timeout=5.0)
    assert receiver.counters == {"bad_header": 1, "no_handshake": 1}


def test_connect_times_out_when_nobody_answers(receiver) -> None:
    sender = create_sender("zmq", LAYOUT)
    try:
        with pytest.raises(TransferTimeout):
            sender.connect(receiver.endpoint, timeout=0.2)  # receiver never polled
    finally:
        sender.close()


def test_other_connector_kind_is_refused(receiver) -> None:
    sender = create_sender("shm", LAYOUT)
    try:
        with pytest.raises(TransferError, match="receiver is 'zmq', not 'shm'"):
            connect_while_polling(sender, receiver)
    finally:
        sender.close()


def test_send_arguments_are_checked(receiver) -> None:
    sender = create_sender("zmq", LAYOUT)
    cache = make_caches(LAYOUT, 4, seed=1)[0]
    try:
        connect_while_polling(sender, receiver)
        with pytest.raises(ValueError, match="out of range"):
            sender.send_layer("x", 2, [0], [0], cache)
        with pytest.raises(ValueError, match="destination blocks"):
            sender.send_layer("x", 0, [0, 1], [0], cache)
        with pytest.raises(ValueError, match="dtype"):
            sender.send_layer("x", 0, [0], [0], cache.to(torch.float16))
    finally:
        sender.close()


def test_zmq_over_ipc(tmp_path) -> None:
    caches = make_caches(LAYOUT, 8, seed=0)
    receiver = create_receiver("zmq", LAYOUT, caches, ipc_path=str(tmp_path / "kv.sock"))
    sender = create_sender("zmq", LAYOUT)
    sent = make_caches(LAYOUT, 4, seed=2)
    try:
        assert receiver.endpoint.startswith("ipc://")
        connect_while_polling(sender, receiver)
        receiver.expect("x", [6, 2])
        for layer in range(LAYOUT.num_layers):
            sender.send_layer("x", layer, [3, 0], [6, 2], sent[layer])
        sender.send_done("x", FirstToken(1))
        (result,) = Pump(receiver).wait_results("x", timeout=5.0)
        assert result.ok, result.error
        assert all(torch.equal(c[:, [6, 2]], s[:, [3, 0]]) for c, s in zip(caches, sent))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("connector", ["zmq", "nccl", "shm"])
def test_receiver_of_another_checksum_scheme_is_refused(connector: str) -> None:
    """An older receiver welcomes without naming a checksum scheme (it used crc32): the
    sender refuses it at connect instead of failing every transfer later."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def old_receiver() -> None:
        if router.poll(5000):
            identity, frame = router.recv_multipart()
            router.send_multipart([identity, encode(KVWelcome(KV_PLANE.decode(frame).digest, {}))])

    thread = threading.Thread(target=old_receiver)
    thread.start()
    sender = create_sender(connector, LAYOUT)
    try:
        with pytest.raises(TransferError, match=f"'crc32.*{re.escape(CHECKSUM_SCHEME)}"):
            sender.connect(f"tcp://127.0.0.1:{port}", timeout=5.0)
    finally:
        thread.join(timeout=5.0)
        sender.close()
        router.close()


def test_shm_frames_dropped_unsent_give_their_ring_slot_back() -> None:
    """Frames are gathered straight into the ring; a frame the fault plan drops must free its
    slot, or with a ring of one frame the next one would wait for credits that never come."""
    ring = 4 * LAYOUT.page_bytes  # 256 bytes: the smallest aligned ring, one frame of 4 pages
    receiver = create_receiver("shm", LAYOUT, make_caches(LAYOUT, 8, seed=0), staging_bytes=ring)
    sender = create_sender("shm", LAYOUT, send_timeout=2.0)
    sender.faults = PlannedFaults(FaultPlan.parse("drop=1"))
    try:
        connect_while_polling(sender, receiver)
        receiver.expect("x", [1, 2, 3, 4])
        cache = make_caches(LAYOUT, 8, seed=1)
        for layer in range(LAYOUT.num_layers):
            sender.send_layer("x", layer, [4, 5, 6, 7], [1, 2, 3, 4], cache[layer])
        sender.send_done("x", FirstToken(0))
        (result,) = Pump(receiver).wait_results("x", timeout=5.0)
        assert not result.ok and "received 0 pages, sender sent 4" in result.error
    finally:
        sender.close()
        receiver.close()


def test_unknown_connector_name() -> None:
    with pytest.raises(ValueError, match="unknown KV connector 'rdma'"):
        create_sender("rdma", LAYOUT)


@pytest.mark.parametrize(
    "plan,ok", [("drop=1", False), ("corrupt=1", False), ("delay=1,delay_s=0.01", True)]
)
def test_fault_plan_frames_fail_the_transfer_never_pass_as_whole(receiver, plan, ok) -> None:
    """A dropped frame is still counted in the done message and a corrupted one fails the
    checksum: the receiver reports the transfer failed instead of admitting partial KV."""
    sender = create_sender("zmq", LAYOUT)
    sender.faults = PlannedFaults(FaultPlan.parse(plan))
    connect_while_polling(sender, receiver)
    try:
        receiver.expect("x", [1, 2, 3])
        cache = make_caches(LAYOUT, 8, seed=1)
        for layer in range(LAYOUT.num_layers):
            sender.send_layer("x", layer, [4, 5, 6], [1, 2, 3], cache[layer])
        sender.send_done("x", FirstToken(1))
        (result,) = Pump(receiver).wait_results("x")
        assert result.ok is ok, result.error
    finally:
        sender.close()


def test_shm_refuses_a_sender_from_another_host(raw: zmq.Socket) -> None:
    """shm's staging file is shared memory of one host: a sender whose host id differs (another
    machine, another network namespace) is refused in the handshake, saying why."""
    from pdserve.common.process import host_id
    from pdserve.kv_transfer.wire import KVRefused

    recv = create_receiver("shm", LAYOUT, make_caches(LAYOUT, 8, seed=0))
    try:
        raw.connect(recv.endpoint)
        for host, kind in (("elsewhere", KVRefused), (host_id(), KVWelcome)):
            raw.send(encode(KVHello("raw", "shm", LAYOUT.digest(), LAYOUT, host)))
            Pump(recv).until(lambda: raw.poll(0) != 0, timeout=5.0, what="an answer")
            reply = KV_PLANE.decode(raw.recv())
            assert isinstance(reply, kind), reply
        refused = recv.counters.get("refused_host")
        assert refused == 1, recv.counters
    finally:
        recv.close()


def test_a_receiver_on_a_wildcard_advertises_a_reachable_address() -> None:
    recv = create_receiver("zmq", LAYOUT, make_caches(LAYOUT, 8, seed=0), host="0.0.0.0")
    try:
        port = recv.endpoint.rpartition(":")[2]
        assert recv.endpoint == f"tcp://0.0.0.0:{port}"
        recv.advertise("127.0.0.1")
        assert recv.endpoint == f"tcp://127.0.0.1:{port}"
        sender = create_sender("zmq", LAYOUT)
        try:
            connect_while_polling(sender, recv)  # the advertised address works
        finally:
            sender.close()
    finally:
        recv.close()


def test_a_receiver_restarted_at_the_same_address_gets_a_new_handshake() -> None:
    """A decode node restarted on a fixed port listens where the old one did; the transport
    would reconnect the old sender silently, to a receiver that never heard its hello. The
    port compares the receiving process (Reserved.kv_instance) and handshakes again."""
    from pdserve.kv_transfer.ranks import KVPort

    recv = create_receiver("zmq", LAYOUT, make_caches(LAYOUT, 8, seed=0))
    port = KVPort("zmq", LAYOUT)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [recv.poll(0.01) for _ in iter(stop.is_set, True)])
    thread.start()
    try:
        first = port.sender(recv.endpoint, "incarnation-1")
        assert port.sender(recv.endpoint, "incarnation-1") is first  # the same process
        again = port.sender(recv.endpoint, "incarnation-2")  # another process there now
        assert again is not first and port.senders == {recv.endpoint: again}
        assert first._sock is None  # the old connection is closed, not reused
        assert port.sender(recv.endpoint) is again  # no instance given: whatever is there
    finally:
        stop.set()
        thread.join(timeout=5.0)
        port.close()
        recv.close()


def test_an_installed_nixl_that_does_not_load_is_named_not_taken_for_absent(
    tmp_path, monkeypatch
) -> None:
    """A broken NIXL install must fail loudly (tests that need nixl then fail, not skip)."""
    import sys

    from pdserve.kv_transfer.base import check_available
    from pdserve.kv_transfer.nixl_agent import load_nixl, nixl_installed

    package = tmp_path / "nixl_cu12"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libucp.so.0: cannot open shared object')"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("nixl_cu12")]:
        monkeypatch.delitem(sys.modules, name)
    assert nixl_installed()
    with pytest.raises(TransferError, match=r"nixl_cu12\) is installed but does not load.*libucp"):
        load_nixl()
    # ... and a node's start says so, through the nixl sender's own check
    with pytest.raises(TransferError, match=r"nixl_cu12\) is installed but does not load.*libucp"):
        check_available("nixl")
    check_available("zmq")  # the others need nothing more

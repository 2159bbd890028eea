"""Request-table edges that mutation testing showed no test pinned (scripts/mutation.sh):
RequestTable and its Stream driven directly (no backend): attempts and wire ids, which nodes
an error leaves behind, what a failover detaches and excludes, heartbeats lost before and
after the hand-off, restarts, and the in-flight counts the nodes are given."""

from __future__ import annotations

import pytest

from pdserve.common.engine.kv_cache_manager import hash_block_tokens
from pdserve.common.wire.messages import Failure, Tokens
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.registry import NodeRegistry
from pdserve.router.cluster.streams import BlockHashes, Failover, RequestTable, Stream, left_behind
from tests.router.test_failover import FakeNodes
from tests.router.test_registry import FakeClock

PROMPT = (1, 2, 3, 4, 5, 6)


def table(*nodes: str) -> RequestTable:
    registry = NodeRegistry(5.0, 4096, FakeClock())
    for node_id in nodes:
        role = "prefill" if node_id.startswith("p") else "decode"
        registry.add(node_id, FakeNodes.registration(node_id, role), 1000.0)
    return RequestTable(registry)


def request(rid: str = "r") -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=8))


def counts(t: RequestTable) -> dict[str, tuple[int, int]]:
    return {n.node_id: (n.inflight, n.local_prefills) for n in t.registry.nodes.values()}


def placed(t: RequestTable, rid: str = "r", prefill: str = "p0", decode: str = "d0") -> Stream:
    stream = t.open(request(rid))
    t.place_decode(stream, decode)
    t.place_prefill(stream, prefill)
    return stream


def drain(stream: Stream) -> list[object]:
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait())
    return out


def test_block_hashes_chain_full_blocks_and_grow_with_the_tokens() -> None:
    tokens = [1, 2, 3, 4, 5]
    hashes = BlockHashes(tokens)
    first = hash_block_tokens(None, [1, 2])
    second = hash_block_tokens(first, [3, 4])
    assert len(hashes) == 5
    assert hashes.of(2) == [first, second]
    assert hashes.of(2, 3) == [first] and hashes.of(2, 1) == []
    assert hashes.of(3) == [hash_block_tokens(None, [1, 2, 3])]
    tokens.append(6)
    assert hashes.of(2) == [first, second, hash_block_tokens(second, [5, 6])]
    assert hashes.of(2, 4) == [first, second]


def test_a_streams_wire_id_names_its_attempt_and_generated_its_tokens() -> None:
    stream = Stream(request())
    assert stream.wire_id == "r" and stream.generated == () and stream.nodes() == set()
    stream.tokens.extend([7, 8])
    stream.attempt = 2
    assert stream.wire_id == "r~2" and stream.generated == (7, 8)
    stream.decode_node = "d0"
    assert stream.nodes() == {"d0"}


@pytest.mark.parametrize(
    ("sender", "kind", "left"),
    [
        ("p0", Failure.BUSY, {"p0"}),
        ("d0", Failure.DRAINING, {"d0"}),
        ("d0", Failure.KV_FAILED, set()),
        ("p0", Failure.KV_FAILED, {"d0"}),
        ("p0", Failure.INTERNAL, None),
        ("d0", Failure.LEASE_EXPIRED, None),
        ("x9", Failure.KV_FAILED, None),
    ],
)
def test_which_nodes_an_error_leaves_behind(sender: str, kind: Failure, left: set | None) -> None:
    stream = Stream(request())
    stream.prefill_node, stream.decode_node = "p0", "d0"
    assert left_behind(stream, sender, kind) == left


def test_kv_failed_from_a_prefill_node_without_a_decode_node_leaves_nothing() -> None:
    stream = Stream(request())
    stream.prefill_node = "p0"
    assert left_behind(stream, "p0", Failure.KV_FAILED) == set()


def test_a_request_is_opened_once_and_forgotten_when_closed() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    assert len(t) == 1 and t.get("r") is stream
    with pytest.raises(AssertionError, match="in flight already"):
        t.open(request())
    assert counts(t) == {"p0": (1, 0), "d0": (1, 0)}
    assert t.held_by("p0", "r") is stream and t.held_by("x9", "r") is None
    assert t.leases(["p0", "d0", "x9"]) == {"p0": ("r",), "d0": ("r",), "x9": ()}
    t.close("r")
    t.close("r")  # twice: nothing more
    assert len(t) == 0 and t.get("r") is None and t.held_by("p0", "r") is None
    assert counts(t) == {"p0": (0, 0), "d0": (0, 0)}
    assert (stream.prefill_node, stream.decode_node) == ("", "")


def test_a_stream_is_placed_once_per_role() -> None:
    t = table("p0", "p1", "d0", "d1")
    stream = placed(t)
    with pytest.raises(AssertionError, match="on p0 already"):
        t.place_prefill(stream, "p1")
    with pytest.raises(AssertionError, match="on d0 already"):
        t.place_decode(stream, "d1")


def test_a_local_prefill_counts_apart_until_its_first_token() -> None:
    t = table("d0")
    one, two = t.open(request("a")), t.open(request("b"))
    t.place_prefill(one, "d0", local=True)
    t.place_prefill(two, "d0", local=True)
    assert counts(t) == {"d0": (2, 2)} and one.local_prefill
    t.deliver("d0", Tokens("a", (9,)), 1.0)
    assert counts(t) == {"d0": (2, 1)} and not one.local_prefill
    t.prefilled(one)  # once only
    assert counts(t) == {"d0": (2, 1)}
    assert one.first_at == 0.0  # no decode node: no hand-off to time
    t.close("b")
    assert counts(t) == {"d0": (1, 0)}


def test_decode_tokens_that_beat_the_first_wait_for_it() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.deliver("d0", Tokens("r", (11,)), 1.0)
    t.deliver("d0", Tokens("r", (12,)), 1.5)
    assert drain(stream) == [] and len(stream.early) == 2
    t.deliver("x9", Tokens("r", (99,)), 1.7)  # not its node: dropped
    t.deliver("p0", Tokens("r", (10,)), 2.0)
    assert [m.token_ids for m in drain(stream)] == [(10,), (11,), (12,)]
    assert stream.early == [] and stream.got_first and stream.first_at == 2.0
    t.deliver("p0", Tokens("r", (13,)), 3.0)  # later ones keep the first's time
    assert stream.first_at == 2.0
    assert t.admitted("p0", "r", 4.0) is None and not stream.admitted
    assert t.admitted("d0", "x", 4.0) is None
    assert t.admitted("d0", "r", 4.5) == 2.5 and stream.admitted


def test_admitted_before_the_first_token_has_no_hand_off_time() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    assert t.admitted("d0", "r", 4.0) is None and stream.admitted


def test_losing_only_the_prefill_node_before_the_first_token_keeps_the_decode_node() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.fail_over(stream, {"p0"}, "p0 busy")
    assert drain(stream) == [Failover("prefill", ("p0",), ("p0",), "p0 busy")]
    assert (stream.prefill_node, stream.decode_node, stream.lost) == ("", "d0", {"p0"})
    assert counts(t) == {"p0": (0, 0), "d0": (1, 0)}


def test_losing_the_prefill_node_after_the_first_token_starts_over() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.deliver("p0", Tokens("r", (10,)), 1.0)
    drain(stream)
    t.fail_over(stream, {"p0"}, "p0 gone", exclude=False)
    [note] = drain(stream)
    assert (note.kind, note.lost, set(note.detached)) == ("resume", (), {"p0", "d0"})
    assert stream.lost == set() and stream.nodes() == set()
    assert counts(t) == {"p0": (0, 0), "d0": (0, 0)}


def test_losing_the_decode_node_detaches_both() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.fail_over(stream, {"d0"}, "d0 full")
    [note] = drain(stream)
    assert (note.kind, note.lost, set(note.detached)) == ("resume", ("d0",), {"p0", "d0"})
    assert stream.lost == {"d0"}


def test_a_prefill_only_request_losing_its_node_resumes() -> None:
    t = table("p0")
    stream = t.open(request())
    t.place_prefill(stream, "p0")
    t.fail_over(stream, {"p0"}, "gone")
    assert drain(stream)[0].kind == "resume"


def test_dead_nodes_fail_over_what_depends_on_them() -> None:
    t = table("p0", "d0", "p1", "d1")
    before, after, other = placed(t, "a"), placed(t, "b"), placed(t, "c", "p1", "d1")
    t.deliver("p0", Tokens("b", (10,)), 1.0)
    t.admitted("d0", "b", 1.0)  # b's KV is all on d0: p0 is done with it
    t.fail_dead({"d0", "p1", "d1"})
    [note] = drain(before)
    assert (note.kind, note.lost, note.why) == ("prefill", ("p0",), "p0 gone")
    assert drain(after) == [Tokens("b", (10,))] and after.nodes() == {"p0", "d0"}
    assert drain(other) == []
    t.fail_dead({"p1"})
    [note] = drain(after)
    assert (note.lost, note.why) == (("d0",), "d0 gone")
    [note] = drain(other)
    assert note.why == "d1 gone"
    # p0 already left: only the reservation kept on d0 is lost now.
    assert drain(before) == [Failover("resume", ("d0",), ("d0",), "d0 gone", "node_gone")]


def test_a_prefill_node_dead_after_the_hand_off_but_before_its_first_token_restarts_it() -> None:
    """The decode node holds the whole KV and decodes (its tokens wait for the first one),
    but the prefill node died before its first token reached the router: nothing would ever
    come. The request starts over (no token reached the client), decode node included."""
    t = table("p0", "d0", "p1", "d1")
    stream = placed(t)
    t.admitted("d0", "r", 1.0)
    t.deliver("d0", Tokens("r", (11,)), 1.0)  # kept until p0's first token
    t.fail_dead({"d0", "p1", "d1"})
    [note] = drain(stream)
    assert (note.kind, note.lost, set(note.detached)) == ("resume", ("p0",), {"p0", "d0"})
    assert stream.nodes() == set() and stream.lost == {"p0"}


def test_a_node_with_both_roles_of_a_request_dead_is_named_once_each() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.fail_dead(set())
    [note] = drain(stream)
    assert set(note.lost) == {"p0", "d0"} and note.why == "d0, p0 gone"


def test_a_restarted_node_fails_over_what_it_held_without_excluding_it() -> None:
    t = table("p0", "d0", "d1")
    one, two = placed(t, "a"), placed(t, "b", "p0", "d1")
    t.node_restarted("d0")
    [note] = drain(one)
    assert (note.kind, note.lost, note.why) == ("resume", (), "d0 restarted")
    assert one.lost == set() and drain(two) == []


def test_a_restart_starts_a_new_attempt_and_forgets_the_old_one() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.deliver("d0", Tokens("r", (11,)), 1.0)
    t.restart(stream)
    assert stream.attempt == 1 and stream.wire_id == "r~1" and not stream.got_first
    assert stream.early == [] and stream.nodes() == set()
    assert counts(t) == {"p0": (0, 0), "d0": (0, 0)}
    t.place_decode(stream, "d0")
    assert t.held_by("d0", "r") is None and t.held_by("d0", "r~1") is stream
    t.restart(stream)
    assert t.held_by("d0", "r~2") is None
    t.place_prefill(stream, "p0")
    assert t.held_by("p0", "r~2") is stream and t.held_by("p0", "r~1") is None
    t.close("r")
    assert t.held_by("p0", "r~2") is None


def test_counts_of_nodes_the_registry_does_not_know_are_skipped() -> None:
    t = table("d0")
    stream = t.open(request())
    t.place_prefill(stream, "x9", local=True)
    assert t.on_node("x9") == [stream] and counts(t) == {"d0": (0, 0)}
    t.close("r")
    assert t.on_node("x9") == []


def test_a_request_placed_again_after_leaving_its_decode_node_is_not_yet_admitted() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.restart(stream)  # left d0 before any hand-off
    t.place_decode(stream, "d0")
    t.place_prefill(stream, "p0")
    t.fail_dead({"d0"})  # p0 gone before the hand-off: the request depends on it
    [note] = drain(stream)
    assert (note.kind, note.lost) == ("prefill", ("p0",))


def test_a_closed_request_leaves_no_wire_id_behind() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.restart(stream)
    t.close("r")
    assert t._by_wire == {} and t._streams == {}


def test_each_failover_adds_to_the_nodes_a_request_never_goes_back_to() -> None:
    t = table("p0", "p1", "d0")
    stream = placed(t)
    t.fail_over(stream, {"p0"}, "p0 busy")
    t.place_prefill(stream, "p1")
    t.fail_over(stream, {"d0"}, "d0 gone")
    assert stream.lost == {"p0", "d0"}


def test_a_restarted_prefill_node_before_the_first_token_keeps_the_decode_reservation() -> None:
    t = table("p0", "d0")
    stream = placed(t)
    t.node_restarted("p0")
    assert drain(stream) == [Failover("prefill", (), ("p0",), "p0 restarted", "node_restarted")]
    assert stream.nodes() == {"d0"} and stream.lost == set()

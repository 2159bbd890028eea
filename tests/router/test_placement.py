"""Prefill placement: the cost model's choice between the decode node and a prefill node, the
threshold and the forced modes, and how the router orders decode nodes for a conversation."""

from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.common.engine.kv_cache_manager import hash_token_blocks
from pdserve.common.wire.messages import Heartbeat, Prefill, Reserved, ReserveKV
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.backend import GenerateRequest
from pdserve.router.cluster.registry import NodeInfo, NodeRegistry
from pdserve.router.cluster.routing import (
    POLICIES,
    PlacementConfig,
    Routing,
    estimate,
    missing_tokens,
)
from pdserve.router.cluster.streams import BlockHashes, RequestTable, Stream

BS = 16
NOW = 1000.0
HISTORY = list(range(1, 601))  # an earlier turn's prompt and answer: 600 tokens
PROMPT = HISTORY + list(range(700, 740))  # the next turn: 40 new tokens
TOKENS = BlockHashes(PROMPT)


def node(name: str, role: str, rate: float = 0.0, holds: list[int] | None = None) -> NodeInfo:
    info = NodeInfo(name, role, "", "zmq", "", 256, 4096, NOW, free_blocks=256, block_size=BS)
    info.prefill_rate = rate
    if holds:
        info.prefixes = set(hash_token_blocks(holds, BS))
    return info


AUTO = PlacementConfig()


def test_missing_tokens_counts_past_the_cached_prefix():
    d = node("d", "decode", holds=HISTORY)
    assert missing_tokens(d, TOKENS, NOW) == len(PROMPT) - 592  # 37 full blocks of 16
    assert missing_tokens(node("e", "decode"), TOKENS, NOW) == len(PROMPT)


def test_a_follow_up_turn_is_prefilled_where_the_conversation_is():
    d, p = node("d", "decode", 1000.0, holds=HISTORY), node("p", "prefill", 1000.0)
    est = estimate(AUTO, d, [p], TOKENS, NOW)
    assert est.local and est.missing_decode == 48 and est.missing_prefill == 640
    assert est.local_s == pytest.approx(48 / 1000) and est.remote_s == pytest.approx(0.64)


def test_a_new_conversation_goes_remote_when_the_decode_node_decodes():
    d, p = node("d", "decode", 1000.0), node("p", "prefill", 1000.0)
    est = estimate(AUTO, d, [p], TOKENS, NOW)
    assert not est.local and est.local_s == est.remote_s  # idle, no hand-off seen: a tie
    d.handoff_s = 0.01  # idle, and a hand-off costs: the decode node prefills it
    assert estimate(AUTO, d, [p], TOKENS, NOW).local
    d.inflight = 1  # one request decodes there and would wait 640 tokens' time
    assert not estimate(AUTO, d, [p], TOKENS, NOW).local
    d.local_prefills = 1  # ... unless that one is itself waiting for a local prefill
    d.queued_tokens = 10
    est = estimate(AUTO, d, [p], TOKENS, NOW)
    assert est.local_s == pytest.approx((10 + 640) / 1000) and not est.local


def test_decodes_waiting_on_the_decode_node_push_prefill_away():
    d, p = node("d", "decode", 1000.0, holds=HISTORY), node("p", "prefill", 1000.0)
    d.inflight = 20  # each of 20 running requests would wait for 48 tokens: 21 * 48 > 640
    assert not estimate(AUTO, d, [p], TOKENS, NOW).local
    d.inflight = 10  # 11 * 48 = 528 < 640
    assert estimate(AUTO, d, [p], TOKENS, NOW).local


def test_queues_rates_and_the_hand_off_enter_the_cost():
    d, p = node("d", "decode", 1000.0), node("p", "prefill", 1000.0)
    short = BlockHashes(list(range(1, 41)))
    assert not estimate(AUTO, d, [p], short, NOW).local  # 40 vs 40 token-times: a tie
    d.handoff_s = 0.05  # the hand-off costs 50 ms: 40 tokens at 1000/s are cheaper here
    assert estimate(AUTO, d, [p], short, NOW).local
    d.handoff_s = 0.0
    p.queued_tokens = 100  # the prefill node has work queued
    assert estimate(AUTO, d, [p], short, NOW).local
    p.queued_tokens, p.prefill_rate = 0, 100.0  # a slow prefill node
    assert estimate(AUTO, d, [p], short, NOW).local
    d.queued_tokens = 1000  # the decode node's own queue
    assert not estimate(AUTO, d, [p], short, NOW).local


def test_an_unmeasured_rate_borrows_the_other_nodes():
    d, p = node("d", "decode"), node("p", "prefill", 2000.0)
    est = estimate(AUTO, d, [p], TOKENS, NOW)
    assert est.remote_s == pytest.approx(len(PROMPT) / 2000)
    assert est.local_s == pytest.approx(len(PROMPT) / 2000)
    both = estimate(AUTO, node("d", "decode"), [node("p", "prefill")], TOKENS, NOW)
    assert both.remote_s == len(PROMPT)  # nothing measured: compared in tokens


def test_remote_counts_the_cheapest_prefill_node():
    d = node("d", "decode", 1000.0, holds=HISTORY)
    busy, warm = node("busy", "prefill", 1000.0), node("warm", "prefill", 1000.0, holds=HISTORY)
    busy.queued_tokens = 5000
    est = estimate(AUTO, d, [busy, warm], TOKENS, NOW)
    assert est.missing_prefill == 48 and est.remote_s == pytest.approx(0.048)
    assert not est.local  # warm holds as much as the decode node: a tie


def test_threshold_replaces_the_cost_model_and_forced_modes_win():
    d, p = node("d", "decode", 1000.0, holds=HISTORY), node("p", "prefill", 1000.0)
    assert estimate(PlacementConfig(threshold=48), d, [p], TOKENS, NOW).local
    assert not estimate(PlacementConfig(threshold=47), d, [p], TOKENS, NOW).local
    assert not estimate(PlacementConfig("remote"), d, [p], TOKENS, NOW).local
    assert not estimate(PlacementConfig("remote"), d, [], TOKENS, NOW).local
    fresh = node("e", "decode", 1000.0)
    assert estimate(PlacementConfig("local"), fresh, [p], TOKENS, NOW).local
    assert estimate(AUTO, fresh, [], TOKENS, NOW).local  # no prefill node: local


@pytest.mark.parametrize(
    ("mode", "threshold"), [("sometimes", None), ("auto", -1)], ids=["mode", "threshold"]
)
def test_bad_placement_settings_are_refused(mode, threshold):
    with pytest.raises(ValueError):
        PlacementConfig(mode, threshold)


def test_rates_from_heartbeats_ignore_nonsense():
    d = node("d", "decode")
    for rate, expected in [(1500.0, 1500.0), (0.0, 1500.0), (math.inf, 1500.0), (math.nan, 1500.0)]:
        d.apply_heartbeat(Heartbeat("d", 10, 0, 0, 0, prefill_rate=rate), NOW)
        assert d.prefill_rate == expected


def test_handoff_is_a_moving_average():
    d = node("d", "decode")
    d.observe_handoff(0.1)
    d.observe_handoff(0.2)
    assert d.handoff_s == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)
    d.observe_handoff(-1.0)  # Admitted raced ahead of the first token: counts as 0
    assert d.handoff_s < 0.12


# -- the router: which node, which message -----------------------------------------------------


class FakeControl:
    """Records what the router sends; a decode node answers ReserveKV with a reservation
    that reports what it holds."""

    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry
        self.sent: list[tuple[str, object]] = []

    async def send(self, node_id: str, msg: object) -> bool:
        self.sent.append((node_id, msg))
        return True

    async def ask(self, node_id: str, key: str, msg: object) -> object:
        self.sent.append((node_id, msg))
        assert isinstance(msg, ReserveKV)
        holder = self.registry.get(node_id)
        tokens = BlockHashes(list(msg.prompt_token_ids))
        cached = len(tokens) - missing_tokens(holder, tokens, NOW)
        blocks = tuple(range(1, -(-len(msg.prompt_token_ids) // BS) + 1))
        return Reserved(msg.request_id, "x", blocks, ("tcp://d:1",), "i", cached_tokens=cached)


def cluster(placement: PlacementConfig) -> tuple[Routing, FakeControl]:
    registry = NodeRegistry(heartbeat_timeout=1e9, default_max_model_len=4096)
    registry.nodes = {
        "p0": node("p0", "prefill", 1000.0),
        "d0": node("d0", "decode", 1000.0),
        "d1": node("d1", "decode", 1000.0, holds=HISTORY),
    }
    for info in registry.nodes.values():
        info.last_seen = float("inf")
    control = FakeControl(registry)
    routing = Routing(RequestTable(registry), control, POLICIES["least_loaded"](), 1.0, placement)
    return routing, control


def route(routing: Routing, prompt: list[int]) -> Stream:
    stream = Stream(GenerateRequest("r", tuple(prompt), SamplingParams(max_tokens=4)))
    assert asyncio.run(routing.route(stream)) is None
    return stream


def test_the_router_prefills_a_follow_up_turn_on_the_decode_node_holding_it():
    routing, control = cluster(AUTO)
    routing.registry.nodes["d1"].inflight = 1  # d0 is less loaded: only the cache picks d1
    stream = route(routing, PROMPT)
    assert stream.prefill_node == "d1" and stream.decode_node == ""
    ((target, msg),) = control.sent
    assert target == "d1" and isinstance(msg, Prefill) and not msg.xfer_id
    assert routing.num_local == 1 and routing.num_remote == 0


def test_forced_remote_sends_only_the_blocks_the_decode_node_lacks():
    routing, control = cluster(PlacementConfig("remote"))
    stream = route(routing, PROMPT)
    assert (stream.decode_node, stream.prefill_node) == ("d1", "p0")
    (_, reserve), (target, prefill) = control.sent
    assert isinstance(reserve, ReserveKV) and target == "p0"
    assert prefill.dest_cached_tokens == 592 and prefill.xfer_id == "x"
    assert (routing.kv_tokens_reused, routing.kv_tokens_sent) == (592, 48)


def test_a_new_conversation_goes_by_the_policy_and_remote():
    routing, control = cluster(AUTO)
    routing.registry.nodes["d0"].inflight = 1
    stream = route(routing, list(range(900, 1300)))  # nothing of it is cached anywhere
    assert (stream.decode_node, stream.prefill_node) == ("d1", "p0")  # d1: less loaded
    assert routing.num_remote == 1


def test_a_shared_system_prompt_alone_does_not_pull_to_one_decode_node():
    """Less than half of the prompt cached on a node is no conversation of its own."""
    routing, _ = cluster(AUTO)
    routing.registry.nodes["d1"].inflight = 1
    stream = route(routing, HISTORY[:200] + list(range(2000, 2300)))
    assert stream.decode_node == "d0"


def test_round_robin_turns_once_per_request():
    """Placement looks at every prefill node without asking the policy: a round robin over
    two prefill nodes alternates."""
    routing, control = cluster(PlacementConfig("remote"))
    routing.registry.nodes["p1"] = node("p1", "prefill", 1000.0)
    routing.registry.nodes["p1"].last_seen = float("inf")
    routing.policy = POLICIES["round_robin"]()
    targets = [route(routing, list(range(900, 1000))).prefill_node for _ in range(4)]
    assert targets == ["p0", "p1", "p0", "p1"]


def test_a_local_prefill_counts_as_decoding_once_its_first_token_came_or_it_left():
    from pdserve.common.wire.messages import Tokens

    registry = NodeRegistry(heartbeat_timeout=1e9, default_max_model_len=4096)
    table = RequestTable(registry)
    routing = Routing(table, FakeControl(registry), POLICIES["least_loaded"](), 1.0)
    d = registry.nodes["d1"] = node("d1", "decode", 1000.0)
    d.last_seen = float("inf")
    for rid in ("a", "b"):
        stream = table.open(GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=4)))
        asyncio.run(routing._run_on(stream, d))
    assert (d.inflight, d.local_prefills) == (2, 2)
    table.deliver("d1", Tokens("a", (5,)), NOW)
    assert (d.inflight, d.local_prefills) == (2, 1)
    table.deliver("d1", Tokens("a", (6,)), NOW)  # later tokens change nothing
    assert d.local_prefills == 1
    table.close("b")  # left before its first token (aborted, failed over)
    assert (d.inflight, d.local_prefills) == (1, 0)
    table.close("a")
    assert (d.inflight, d.local_prefills) == (0, 0)


@pytest.mark.parametrize("mode", ["local", "auto"])
def test_forced_local_placement_is_ready_with_decode_nodes_alone(mode: str) -> None:
    """With --prefill-placement local a decode node runs requests whole: /health says ready
    without any prefill node. Other modes still need a prefill node that can fill one."""
    from pdserve.router.cluster.backend import ClusterBackend
    from tests.router.test_failover import backend_config

    backend = ClusterBackend(backend_config(PlacementConfig(mode)))
    assert not backend.ready()
    assert "decode" in backend.unready_reason()
    d = backend.registry.nodes["d1"] = node("d1", "decode", 1000.0)
    d.last_seen = float("inf")
    assert backend.ready() is (mode == "local")
    d.draining = True  # a draining decode node takes nothing new
    assert not backend.ready()

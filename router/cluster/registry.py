"""The nodes the router knows: what each one reported (role, KV endpoint, load, prefix
cache), and which of them are alive and take new requests."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.common.wire.messages import Heartbeat, RegisterNode
from pdserve.common.wire.payloads import KVLayout, SpecDecodeCounts, TierCounts

NODE_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class TierCredit:
    """What loading a cached block costs, by the medium that holds it, as a fraction of
    computing it: a block in the node's device pool costs nothing, one in its host tier a copy
    into the pool, one in the shared store a read from it (1 or more: worth nothing). Prefix-
    aware placement and the local/remote prefill choice credit a prompt's leading blocks with
    what they save (`saved`)."""

    host_cost: float = 0.1
    shared_cost: float = 0.5

    def __post_init__(self) -> None:
        for name in ("host_cost", "shared_cost"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"KV {name} must be a fraction >= 0, got {getattr(self, name)}")

    def saved(self, cost: float) -> float:
        return max(0.0, 1.0 - cost)


class StoreView:
    """The blocks nodes of one shared KV store said they wrote there, the latest last, less
    those a node since found gone (a miss there, or its own eviction sweep). A store evicts
    without telling anyone (another node's sweep, Redis's LRU), so the view is a bounded hint:
    a block it lists that is gone costs a recompute, never a wrong token, and the first node
    to miss it reports it."""

    def __init__(self, limit: int = 1 << 17) -> None:
        self.limit = limit
        self.blocks: dict[bytes, None] = {}

    def add(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.blocks.pop(h, None)
            self.blocks[h] = None
        while len(self.blocks) > self.limit:
            del self.blocks[next(iter(self.blocks))]

    def discard(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.blocks.pop(h, None)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks


@dataclass(slots=True)
class NodeInfo:
    """What the router knows of one node, refreshed by its heartbeats."""

    node_id: str
    role: str
    kv_endpoints: tuple[str, ...]
    kv_connector: str
    layout_digest: str
    num_blocks: int
    max_model_len: int
    last_seen: float
    free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0
    inflight: int = 0  # requests routed there and not ended (the RequestTable's count)
    block_size: int = 16
    # Prefix cache as the node reports it (block hash set) plus what the router has sent
    # there since (hash -> expiry time), and prompt tokens sent since its last heartbeat.
    prefixes: set[bytes] = field(default_factory=set)
    prefix_seq: int = 0
    recent_prefixes: dict[bytes, float] = field(default_factory=dict)
    recent_tokens: int = 0
    draining: bool = False  # shutting down: takes no new requests
    incarnation: str = ""  # the node process's random start id (a restart changes it)
    host_id: str = ""  # the host it runs on (shm connects only nodes of one host)
    kv_layout: KVLayout | None = None  # of its KV cache (None: it moves no KV)
    tp_size: int = 1  # its tensor-parallel ranks: a prefill node's is ReserveKV.src_tp
    prefill_rate: float = 0.0  # prompt tokens/s the node measured (0: none measured yet)
    # A decode node: seconds from the prefill node's first token to Admitted (the hand-off
    # of the last pages), as this router observed it lately.
    handoff_s: float = 0.0
    local_prefills: int = 0  # a decode node: local prefills before their first token (idem)
    spec_decode: SpecDecodeCounts | None = None  # its latest speculative-decoding counters
    # Its host KV tier as it reports it, the shared store it uses (the registry's one view of
    # that store, or None), what a block saves by medium, and its tiers' latest counters.
    host_prefixes: set[bytes] = field(default_factory=set)
    store: StoreView | None = None
    credit: TierCredit = field(default_factory=TierCredit)
    kv_tiers: tuple[TierCounts, ...] = ()
    kv_tier_loaded_tokens: int = 0
    busy_seconds: float = 0.0  # in its steps that ran work, as it last reported (0: none)

    def load(self) -> tuple[int, int]:
        return (self.inflight + self.num_waiting, -self.free_blocks)

    def apply_heartbeat(self, msg: Heartbeat, now: float) -> bool:
        """Take a heartbeat's load and prefix-cache changes; False when the prefix changes
        have a gap (the view is then empty until the node sends a snapshot)."""
        self.free_blocks, self.num_running = msg.free_blocks, msg.num_running
        self.num_waiting, self.queued_tokens = msg.num_waiting, msg.queued_tokens
        self.recent_tokens = 0  # now counted in queued_tokens
        self.draining = msg.draining
        self.spec_decode = msg.spec_decode
        self.kv_tiers, self.kv_tier_loaded_tokens = msg.kv_tiers, msg.kv_tier_loaded_tokens
        self.busy_seconds = msg.busy_seconds
        if 0 < msg.prefill_rate < math.inf:
            self.prefill_rate = msg.prefill_rate
        self.recent_prefixes = {h: t for h, t in self.recent_prefixes.items() if t > now}
        if self.store is not None:  # written there whatever became of the node's own view
            self.store.add(msg.shared_stored)  # a block is in one list: its latest change
            self.store.discard(msg.shared_removed)
        if not msg.prefix_seq:
            return True  # this node does not report its prefix cache
        in_order = msg.prefix_seq == self.prefix_seq + 1
        self.prefix_seq = msg.prefix_seq
        if msg.prefix_reset:
            self.prefixes, self.host_prefixes = set(msg.prefix_stored), set(msg.host_stored)
            return True
        if not in_order:  # what it holds now is unknown: count none of it until a snapshot
            self.prefixes.clear()
            self.host_prefixes.clear()
            return False
        self.prefixes.difference_update(msg.prefix_removed)
        self.prefixes.update(msg.prefix_stored)
        self.host_prefixes.difference_update(msg.host_removed)
        self.host_prefixes.update(msg.host_stored)
        return True

    def cached_blocks(self, hashes: list[bytes], now: float) -> int:
        """How many leading blocks of a prompt (its chained block hashes) this node holds or
        is about to hold in its device pool."""
        n = 0
        for h in hashes:
            if not self.on_device(h, now):
                break
            n += 1
        return n

    def on_device(self, block_hash: bytes, now: float) -> bool:
        return block_hash in self.prefixes or self.recent_prefixes.get(block_hash, 0.0) > now

    def block_credit(self, block_hash: bytes, now: float) -> float:
        """What the node holding this block saves (`TierCredit`; 0: it holds none)."""
        if self.on_device(block_hash, now):
            return 1.0
        if block_hash in self.host_prefixes:
            return self.credit.saved(self.credit.host_cost)
        if self.store is not None and block_hash in self.store:
            return self.credit.saved(self.credit.shared_cost)
        return 0.0

    def credited_tokens(self, hashes: list[bytes], now: float) -> int:
        """The prompt tokens the node need not compute, counting its leading cached blocks
        by the medium holding each (a node loads a prefix up to its first missing block)."""
        credit = 0.0
        for h in hashes:
            saved = self.block_credit(h, now)
            if saved <= 0:
                break
            credit += saved
        return math.floor(credit * self.block_size + 1e-9)

    def routed(self, num_tokens: int, hashes: list[bytes], now: float, ttl: float = 5.0) -> None:
        """Tokens were sent here to compute (their leading block hashes given): those past the
        blocks it holds count as queued work, and the blocks are expected cached soon."""
        self.recent_tokens += num_tokens - self.cached_blocks(hashes, now) * self.block_size
        self.expect_cached(hashes, now, ttl)

    def expect_cached(self, hashes: list[bytes], now: float, ttl: float = 5.0) -> None:
        """Blocks the node will hold soon (before its heartbeat says so)."""
        for h in hashes:
            self.recent_prefixes[h] = now + ttl

    def observe_handoff(self, seconds: float, weight: float = 0.2) -> None:
        """A hand-off to this decode node took `seconds` (moving average)."""
        seconds = max(0.0, seconds)
        self.handoff_s = (
            seconds if not self.handoff_s else ((1 - weight) * self.handoff_s + weight * seconds)
        )


def kv_tier_totals(nodes: Iterable[NodeInfo]) -> dict[str, float]:
    """Live nodes' KV tier counters summed per tier (`kv_tier_<counter>_<tier>`, the counters
    of `TierCounts`) and the prompt tokens they loaded instead of recomputing (nothing when
    no node has tiers). Each node counts since it started: a node gone takes its counts."""
    out: dict[str, float] = {}
    for node in nodes:
        for counts in node.kv_tiers:
            for f in dataclasses.fields(counts):
                if f.name != "tier":
                    key = f"kv_tier_{f.name}_{counts.tier}"
                    out[key] = out.get(key, 0) + getattr(counts, f.name)
        if node.kv_tiers:
            out["kv_tier_loaded_tokens"] = out.get("kv_tier_loaded_tokens", 0) + (
                node.kv_tier_loaded_tokens
            )
    return out


def spec_decode_totals(counts: Iterable[SpecDecodeCounts | None]) -> dict[str, float]:
    """Live nodes' speculative-decoding counters summed, under vLLM's names (nothing when no
    node speculates). Each node counts since it started: a node gone takes its counts along."""
    known = [c for c in counts if c is not None]
    if not known:
        return {}
    out = {
        "spec_decode_num_drafts": sum(c.num_drafts for c in known),
        "spec_decode_num_draft_tokens": sum(c.num_draft_tokens for c in known),
        "spec_decode_num_accepted_tokens": sum(c.num_accepted_tokens for c in known),
    }
    for c in known:
        for pos, n in enumerate(c.accepted_per_position):
            key = f"spec_decode_num_accepted_tokens_per_pos_{pos}"
            out[key] = out.get(key, 0) + n
    return out


def kv_mismatch(prefill: NodeInfo, decode: NodeInfo) -> str | None:
    """Why `prefill` cannot send KV to `decode` (None: it can): both ends must run the same
    connector on the same cache layout, and shm's ends must share a host."""
    if prefill.kv_connector != decode.kv_connector:
        return f"connectors differ ({prefill.kv_connector} -> {decode.kv_connector})"
    if prefill.layout_digest != decode.layout_digest:
        p, d = prefill.kv_layout, decode.kv_layout
        differs = p.describe_mismatch(d, ("prefill", "decode")) if p and d else ""
        return differs or "KV layout mismatch: the digests differ"
    if prefill.kv_connector == "shm" and prefill.host_id != decode.host_id:
        return "shm needs both on one host, and they run on different hosts"
    return None


class LoopLag:
    """How long the router's own event loop has lately been unable to run its tasks (a long
    garbage collection, a burst of work): heartbeats that arrived meanwhile wait unread in
    the socket, so a node is not late by that much.

    A ticker task runs every `tick` seconds; a tick that comes late by more than `tick` is a
    stall, remembered for `window` seconds after it ended. A stall still going on (the ticker
    has not run for a while) counts too, so a task judging nodes right after the loop wakes
    sees it before the ticker does.

    The ticker reads the time from `clock` (seconds; a test passes a fake one)."""

    def __init__(
        self, window: float, tick: float = 0.05, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self.tick = tick
        self.clock = clock
        self._last: float | None = None  # the ticker's last run; None until it runs
        self._stalls: list[tuple[float, float]] = []  # (when it ended, how long it was)

    def ticked(self, now: float) -> None:
        late = now - (self._last if self._last is not None else now) - self.tick
        self._last = now
        if late > self.tick:
            self._stalls.append((now, late))
        self._stalls = [(t, d) for t, d in self._stalls if t > now - self.window]

    def recent(self, now: float) -> float:
        """The longest stall in the window, the one going on included (seconds)."""
        ongoing = now - self._last - self.tick if self._last is not None else 0.0
        return max([0.0, ongoing, *(d for t, d in self._stalls if t > now - self.window)])

    async def run(self) -> None:
        self._last = self.clock()
        while True:
            await asyncio.sleep(self.tick)
            self.ticked(self.clock())


class NodeRegistry:
    """Nodes by id, as they registered; a node is alive while it is heard from within
    heartbeat_timeout, not counting the time the router's loop itself stood still (`lag`).

    The timeout is judged by `clock` (seconds, the time base of the `now` given to add(); a
    test passes a fake one), which the loop-lag ticker reads too."""

    def __init__(
        self,
        heartbeat_timeout: float,
        default_max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        credit: TierCredit | None = None,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.credit = credit or TierCredit()
        self.stores: dict[str, StoreView] = {}  # by the id nodes give (URL and key space)
        self.default_max_model_len = default_max_model_len
        self.nodes: dict[str, NodeInfo] = {}
        self.clock = clock
        self.lag = LoopLag(window=heartbeat_timeout, clock=clock)

    def get(self, node_id: str) -> NodeInfo | None:
        return self.nodes.get(node_id)

    def add(self, node_id: str, msg: RegisterNode, now: float) -> None:
        """Take a node as it registers (again): what was known of it before is dropped."""
        self.nodes[node_id] = NodeInfo(
            node_id=node_id,
            role=msg.role,
            kv_endpoints=msg.kv_endpoints,
            kv_connector=msg.kv_connector,
            layout_digest=msg.layout_digest,
            num_blocks=msg.num_blocks,
            max_model_len=msg.max_model_len,
            last_seen=now,
            free_blocks=msg.num_blocks,
            block_size=msg.block_size,
            incarnation=msg.incarnation,
            host_id=msg.host_id,
            kv_layout=msg.kv_layout,
            tp_size=msg.tp_size,
            store=self.stores.setdefault(msg.kv_store, StoreView()) if msg.kv_store else None,
            credit=self.credit,
        )

    def alive(self, roles: tuple[str, ...]) -> list[NodeInfo]:
        """Nodes of these roles heard from within the heartbeat timeout (plus the router's
        own recent stall)."""
        now = self.clock()
        cutoff = now - self.heartbeat_timeout - self.lag.recent(now)
        return [n for n in self.nodes.values() if n.role in roles and n.last_seen >= cutoff]

    def routable(self, roles: tuple[str, ...], exclude: set[str] = frozenset()) -> list[NodeInfo]:
        """Live nodes that take new requests (not draining, not excluded)."""
        return [n for n in self.alive(roles) if not n.draining and n.node_id not in exclude]

    def no_route_reason(self, exclude: set[str] = frozenset()) -> str:
        """Why prefill and decode nodes (less `exclude`) make no route, for a client's error."""
        prefills = self.routable(("prefill",), exclude)
        decodes = self.routable(("decode",), exclude)
        if not (prefills and decodes):
            return "no prefill/decode route is available"
        p, d = prefills[0], decodes[0]
        return (
            f"no prefill node can send KV to a decode node (e.g. {p.node_id} -> {d.node_id}: "
            f"{kv_mismatch(p, d)})"
        )

    def unpairable(self, node_id: str) -> str | None:
        """Why a prefill or decode node can send KV to (or take KV from) none of the live
        nodes of the other role, when there are some (None: it can, or none are there)."""
        node = self.nodes[node_id]
        other = {"prefill": "decode", "decode": "prefill"}.get(node.role)
        peers = self.routable((other,)) if other else []
        if not peers:
            return None
        pairs = [(node, peer) if node.role == "prefill" else (peer, node) for peer in peers]
        reasons = [kv_mismatch(p, d) for p, d in pairs]
        return None if None in reasons else reasons[0]

    @property
    def max_model_len(self) -> int:
        """The tightest limit among live nodes (every node must be able to hold a request)."""
        lens = [n.max_model_len for n in self.alive(NODE_ROLES)]
        return min([self.default_max_model_len, *lens])

    def ready(self) -> bool:
        """Whether some route takes requests: a colocated node, or a prefill node that can send
        KV to a decode node."""
        if self.routable(("both",)):
            return True
        prefills = self.routable(("prefill",))
        return any(kv_mismatch(p, d) is None for d in self.routable(("decode",)) for p in prefills)

    def stats(self) -> dict[str, float]:
        """Live nodes of each role, and the prefix-cache blocks live prefill nodes reported
        holding (what prefix-aware placement reads)."""
        return {
            "nodes_prefill": len(self.alive(("prefill",))),
            "nodes_decode": len(self.alive(("decode",))),
            "nodes_colocated": len(self.alive(("both",))),
            "prefix_blocks_prefill": sum(len(n.prefixes) for n in self.alive(("prefill",))),
            **spec_decode_totals(n.spec_decode for n in self.alive(NODE_ROLES)),
            **kv_tier_totals(self.alive(NODE_ROLES)),
        }

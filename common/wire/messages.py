"""Control-plane wire protocol: typed messages as msgpack maps with `type` and `version`.

Decoding is bounded and strict: a frame larger than MAX_MESSAGE_BYTES, a map with an unknown
`type`, another protocol version, a missing or unknown field, or a field of the wrong type is
refused with ProtocolError. A field typed as a dataclass (sampling parameters, logprobs, the
first token) travels as a map of its fields and is checked the same way, field by field, and
then by the dataclass's own validation. Callers count and drop such frames; nothing on the
wire can crash a node. There is no pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from pdserve.common.wire.payloads import (
    KVLayout,
    SamplingParams,
    SpecDecodeCounts,
    StageTimes,
    TierCounts,
    TokenLogprobs,
)

PROTOCOL_VERSION = 13  # 2: typed failure kinds, incarnations, Reregister; 3: Registered,
# host ids; 4: the decode side's cached tokens in Reserved/Prefill, measured rates; 5: typed
# sampling parameters and logprobs (maps checked field by field), KVDone's typed first token;
# 6: KV layouts typed (RegisterNode, KVHello), the KV data plane decoded on its own;
# 7: tensor parallelism: a node's TP size and every rank's KV endpoint, the sending group's TP
# in ReserveKV and RenewTransfer; 8: nixl carries head slices (kvx.expect's heads, the welcome's
# agent name); 9: tracing: the W3C traceparent in ReserveKV and Prefill, the stage times in
# Tokens; 10: heartbeats carry speculative-decoding counters (spec_decode); 11: the error kind
# tp_broken (a node whose TP group broke fences the requests it held); 12: KV tiers: the host
# tier's blocks and the shared-store writes in heartbeats, per-tier counters, the store's id;
# 13: the shared store's blocks a node found gone (shared_removed) in heartbeats
MAX_MESSAGE_BYTES = 32 * 1024 * 1024  # a 1M-token prompt of int64 ids fits with room to spare


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version. `request_id` names the
    request of a refused frame that said which one it was about ("" otherwise): the receiver
    can fail that request at once instead of letting it time out."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message; subclasses set TYPE and are registered with one plane."""

    TYPE: ClassVar[str] = ""


class Plane:
    """The message types one kind of socket carries. The control plane (router <-> nodes) and
    the KV data plane (prefill -> decode) are separate: a frame of one plane arriving on the
    other's socket is refused as an unknown type."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.types: dict[str, type[Message]] = {}

    def register(self, cls: type[Message]) -> type[Message]:
        """Register a message class under its TYPE (once)."""
        assert cls.TYPE and cls.TYPE not in self.types, f"bad or duplicate type {cls.TYPE!r}"
        self.types[cls.TYPE] = cls
        return cls

    def decode(self, frame: bytes) -> Message:
        """Parse and type-check one frame; ProtocolError on anything unexpected."""
        if len(frame) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(f"undecodable message: {type(exc).__name__}") from None
        if not isinstance(body, dict):
            raise ProtocolError("message is not a map")
        cls = self.types.get(body.pop("type", None))  # type: ignore[arg-type]
        if cls is None:
            raise ProtocolError(f"unknown message type on the {self.name} plane")
        if body.pop("version", None) != PROTOCOL_VERSION:
            raise ProtocolError(f"{cls.TYPE}: protocol version must be {PROTOCOL_VERSION}")
        try:
            return _build(cls, body, cls.TYPE)
        except ProtocolError as exc:
            rid = body.get("request_id")
            raise ProtocolError(str(exc), rid if isinstance(rid, str) else "") from None


CONTROL = Plane("control")
message = CONTROL.register  # the control messages below; the KV data plane has its own
decode = CONTROL.decode


def encode(msg: Message) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    body["type"] = msg.TYPE
    body["version"] = PROTOCOL_VERSION
    return msgpack.packb(body, use_bin_type=True, default=_as_map)


def _as_map(value: Any) -> dict[str, Any]:
    """msgpack's hook for what it cannot pack itself: a nested dataclass as a map of its
    fields (only called for such values, so plain messages pay nothing)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"{type(value).__name__} cannot go on the wire")


def _build(cls: type, body: dict[str, Any], where: str) -> Any:
    """A message, or a dataclass nested in one, from its map: every field known, every field
    without a default present, each of its type, then the class's own checks."""
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    unknown = set(body) - {f.name for f in fields}
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {sorted(unknown)[:5]}")
    kwargs = {}
    for f in fields:
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{where}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _check(body[f.name], hints[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}: {exc}") from None


_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINT_CACHE:
        _HINT_CACHE[cls] = typing.get_type_hints(cls)
    return _HINT_CACHE[cls]


def _check(value: Any, hint: Any, where: str) -> Any:
    """Validate value against a type hint of the small vocabulary messages use."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None) and value is None:
                return None
        non_none = [a for a in args if a is not type(None)]
        return _check(value, non_none[0], where) if value is not None else _fail(where, hint)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return _fail(where, hint)
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed shape
            if len(value) != len(args):
                return _fail(where, hint)
            return tuple(_check(v, a, where) for v, a in zip(value, args))
        item = args[0] if args else Any
        # Fast path for the long homogeneous lists the wire carries (block ids, token ids):
        # one C-level type test per element instead of a recursive call; bool is not int here.
        if item in (int, str) and all(type(v) is item for v in value):
            return tuple(value)
        return tuple(_check(v, item, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            return _fail(where, hint)
        return {_check(k, args[0], where): _check(v, args[1], where) for k, v in value.items()}
    if hint is Any:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where) if isinstance(value, dict) else _fail(where, hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            return _fail(where, hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        return _fail(where, hint)
    if not isinstance(value, hint):
        return _fail(where, hint)
    return value


def _fail(where: str, hint: Any) -> Any:
    raise ProtocolError(f"{where}: expected {getattr(hint, '__name__', hint)}")


def _positive_tp(size: int) -> None:
    if size < 1:
        raise ValueError(f"a tensor-parallel size must be >= 1, got {size}")


# -- messages ---------------------------------------------------------------------------------


class Failure(str, enum.Enum):
    """Why a request failed, said once, in the terms the router acts on (no HTTP codes or
    message text to re-read)."""

    BAD_REQUEST = "bad_request"  # the request itself is invalid: the client's error (400)
    BUSY = "busy"  # the node holds all it can: another node may take the request
    DRAINING = "draining"  # the node is shutting down: another node may take the request
    # A rank of the node's tensor-parallel group is gone: the node stops and fences what it
    # held (another node may take it; no token of it will come from here).
    TP_BROKEN = "tp_broken"
    KV_FAILED = "kv_failed"  # the KV transfer failed: retry from the tokens already streamed
    LEASE_EXPIRED = "lease_expired"  # the router stopped renewing: the node freed it
    NO_RESERVATION = "no_reservation"  # a transfer to renew is not held (any more)
    UNAVAILABLE = "unavailable"  # (router) no node can take it now: the client may retry
    TIMEOUT = "timeout"  # (router) no token within the token timeout
    INTERNAL = "internal"

    @property
    def elsewhere(self) -> bool:
        """Another node may succeed where this one refused."""
        return self in (Failure.BUSY, Failure.DRAINING, Failure.TP_BROKEN)


@message
@dataclass(frozen=True, slots=True)
class Abort(Message):
    """End a request wherever it is; idempotent."""

    TYPE: ClassVar[str] = "abort"
    request_id: str
    reason: str = ""


@message
@dataclass(frozen=True, slots=True)
class Error(Message):
    """A request failed; the router fails it over, retries it, or turns it into
    finish_reason "error" (or an HTTP error), by its kind."""

    TYPE: ClassVar[str] = "error"
    request_id: str
    message: str
    kind: Failure = Failure.INTERNAL


@message
@dataclass(frozen=True, slots=True)
class CheckIntegrity(Message):
    """Ask a node to run its block pool's integrity check and report usage."""

    TYPE: ClassVar[str] = "check_integrity"
    nonce: int = 0


@message
@dataclass(frozen=True, slots=True)
class IntegrityReport(Message):
    TYPE: ClassVar[str] = "integrity_report"
    nonce: int
    ok: bool
    detail: str = ""
    num_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    live_requests: tuple[str, ...] = field(default_factory=tuple)


# -- node registry (node -> router) -----------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class RegisterNode(Message):
    """A node announces itself to the router when it starts (and again after a reconnect)."""

    TYPE: ClassVar[str] = "register_node"
    node_id: str
    role: str  # "prefill" | "decode" | "both"
    # Where its KV receivers listen, one per tensor-parallel rank, rank 0 first (empty on
    # prefill-only nodes).
    kv_endpoints: tuple[str, ...]
    kv_connector: str
    layout_digest: str
    num_blocks: int
    block_size: int
    max_model_len: int
    # Random per process start: the same node id with a new incarnation is a restarted node,
    # which holds none of the requests the router had sent to the old one.
    incarnation: str = ""
    # Which host the node runs on (boot id and network namespace): shm moves KV only between
    # nodes of one host.
    host_id: str = ""
    # The KV cache layout behind layout_digest (None on a node without KV connector): the
    # router names what differs when a prefill node cannot send KV to a decode node.
    kv_layout: KVLayout | None = None
    tp_size: int = 1  # the node's tensor-parallel ranks (processes)
    # The shared KV store it reads and writes (its URL and key space; "" for none): the router
    # credits a block one node wrote there to every node of the same store.
    kv_store: str = ""

    def __post_init__(self) -> None:
        _positive_tp(self.tp_size)
        if self.kv_endpoints and len(self.kv_endpoints) != self.tp_size:
            raise ValueError(f"{len(self.kv_endpoints)} KV endpoints for {self.tp_size} ranks")


@message
@dataclass(frozen=True, slots=True)
class Registered(Message):
    """Router -> node: the answer to RegisterNode. A refusal names what is wrong (a KV endpoint
    the router cannot reach: a wrong --advertise-host); the node stops with that error."""

    TYPE: ClassVar[str] = "registered"
    accepted: bool = True
    reason: str = ""


@message
@dataclass(frozen=True, slots=True)
class Reregister(Message):
    """Router -> node: a message from a node this router does not know (the router restarted,
    or forgot the node): register again."""

    TYPE: ClassVar[str] = "reregister"


@message
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Load report; also renews the node's leases."""

    TYPE: ClassVar[str] = "heartbeat"
    node_id: str
    free_blocks: int
    num_running: int
    num_waiting: int
    queued_tokens: int
    # Prefix-cache changes since the last heartbeat (prefill and colocated nodes), numbered so
    # the router can tell a gap; a reset replaces the router's view with prefix_stored.
    prefix_seq: int = 0
    prefix_reset: bool = False
    prefix_stored: tuple[bytes, ...] = ()
    prefix_removed: tuple[bytes, ...] = ()
    # The same for its host KV tier (under the same number; a reset lists it whole), and the
    # blocks it wrote to its shared store since (nodes of that store may load them) and those
    # it found gone from there (a miss, or its own eviction sweep: the router forgets them).
    host_stored: tuple[bytes, ...] = ()
    host_removed: tuple[bytes, ...] = ()
    shared_stored: tuple[bytes, ...] = ()
    shared_removed: tuple[bytes, ...] = ()
    draining: bool = False  # shutting down: finishing what it holds, taking nothing new
    prefill_rate: float = 0.0  # prompt tokens/s of its recent prefill steps (0: none yet)
    spec_decode: SpecDecodeCounts | None = None  # None: the node does not speculate
    # Its KV tiers' counters since it started (none: no tiers), and the prompt tokens it
    # loaded from them instead of recomputing; the router sums both over live nodes.
    kv_tiers: tuple[TierCounts, ...] = ()
    kv_tier_loaded_tokens: int = 0
    # Seconds it spent in steps that ran work since it started (a decode node's; 0: not
    # reported): its tokens per busy second are its capacity (the planner's decode rate).
    busy_seconds: float = 0.0


@message
@dataclass(frozen=True, slots=True)
class Alive(Message):
    """Node -> router from the node's liveness thread, on a second socket whose identity is
    `<node_id>#alive`: the process runs and its loop made progress lately, however long one
    step takes (a long prefill must not look like a dead node)."""

    TYPE: ClassVar[str] = "alive"
    node_id: str


ALIVE_SUFFIX = "#alive"


@message
@dataclass(frozen=True, slots=True)
class Lease(Message):
    """Router -> node, every lease interval: the requests the router still wants from this
    node. A request a node holds that goes unlisted for its lease timeout is freed and failed
    (so a lost abort or a dead router never pins blocks)."""

    TYPE: ClassVar[str] = "lease"
    request_ids: tuple[str, ...]


@message
@dataclass(frozen=True, slots=True)
class SyncPrefixes(Message):
    """Router -> node: its view of the node's prefix cache has a gap; send a full snapshot."""

    TYPE: ClassVar[str] = "sync_prefixes"


# -- request flow -----------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class ReserveKV(Message):
    """Router -> decode node: allocate the prompt's blocks now (admission control)."""

    TYPE: ClassVar[str] = "reserve_kv"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    output_token_ids: tuple[int, ...] = ()  # a resumed request: tokens already streamed
    # The TP size of the prefill node that will send: each decode rank expects one slice from
    # each prefill rank that holds some of its KV heads (common/wire/payloads.py).
    src_tp: int = 1
    traceparent: str | None = None  # the router's request span, when the request is traced

    def __post_init__(self) -> None:
        _positive_tp(self.src_tp)


@message
@dataclass(frozen=True, slots=True)
class Reserved(Message):
    """Decode node -> router: the blocks are held for xfer_id until KVDone or the lease ends."""

    TYPE: ClassVar[str] = "reserved"
    request_id: str
    xfer_id: str
    block_ids: tuple[int, ...]
    kv_endpoints: tuple[str, ...]  # every rank's receiver, rank 0 first
    # The decode process's incarnation: a prefill node connected to kv_endpoints before holds
    # a connection to another process if this differs (a restart on the same address and
    # port) and must handshake again.
    kv_instance: str = ""
    # Leading prompt tokens whose KV the decode node already holds (its prefix cache): the
    # prefill node sends only the blocks from cached_tokens // block_size on.
    cached_tokens: int = 0
    src_tp: int = 1  # the sending TP size its ranks expect slices from (ReserveKV.src_tp)


@message
@dataclass(frozen=True, slots=True)
class Busy(Message):
    """Decode node -> router: no room now; try another node or later."""

    TYPE: ClassVar[str] = "busy"
    request_id: str
    reason: str = ""


@message
@dataclass(frozen=True, slots=True)
class Prefill(Message):
    """Router -> prefill node: compute the prompt, stream its KV into the reserved blocks."""

    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    xfer_id: str = ""  # empty for a colocated ("both") node: it decodes itself
    dest_block_ids: tuple[int, ...] = ()
    dest_kv_endpoints: tuple[str, ...] = ()  # Reserved.kv_endpoints
    dest_kv_instance: str = ""  # Reserved.kv_instance
    dest_cached_tokens: int = 0  # Reserved.cached_tokens: the blocks below need no transfer
    output_token_ids: tuple[int, ...] = ()  # a resumed request: tokens already streamed
    traceparent: str | None = None  # the router's request span (ReserveKV.traceparent)


@message
@dataclass(frozen=True, slots=True)
class RenewTransfer(Message):
    """Router -> decode node: another prefill node feeds this reservation (the old one died,
    or the router picked one of another TP size); keep the blocks, forget the old transfer
    (late frames are dropped) and answer Reserved with a new xfer id."""

    TYPE: ClassVar[str] = "renew_transfer"
    request_id: str
    src_tp: int = 1  # ReserveKV.src_tp of the new sender

    def __post_init__(self) -> None:
        _positive_tp(self.src_tp)


@message
@dataclass(frozen=True, slots=True)
class Admitted(Message):
    """Decode node -> router: the KV arrived whole and the request runs here now."""

    TYPE: ClassVar[str] = "admitted"
    request_id: str


@message
@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """Node -> router: new tokens of a request (the first one comes from the prefill node)."""

    TYPE: ClassVar[str] = "tokens"
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked
    finish_reason: str = ""  # "" while running
    cached_tokens: int = 0
    # Of prompt tokens 1, 2, ... (with ranks); first message only, when the request asked for
    # prompt logprobs.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # The node's stages of the request, with the first token it computed (StageTimes).
    stages: StageTimes | None = None

"""The typed values that travel inside messages, torch-free: what a request asks for
(SamplingParams and its StructuredOutputsParams), what a step produced (TokenLogprobs, and the
FirstToken a prefill node hands to the decode node), and what a KV page means (KVLayout).

A message field of one of these types travels as a map of its fields, checked field by field
and then by the class's own validation (messages.py): a node receives the same validated value
the router built. The engine, the router and the KV connectors import them from here; nothing
here imports the engine.

Sampling parameters are validated where the user hands them in. The KV layout is what both
ends of a transfer must agree on before any page moves: a page written into a block of a cache
with another dtype, head count or block size would be silently wrong tokens later, so the
handshake compares a digest of it and refuses a mismatch, and the router compares layouts with
this very class. Beside it, how a tensor-parallel group splits the layout's KV heads: which
heads each rank holds, and which slices a prefill group at TP p sends a decode group at TP d
(the model's shards, the KV connectors and the router's pairing read these same functions).
KV heads split evenly when the group's size divides their number; when the size is a multiple
of it, each head is held by `size // num_kv_heads` consecutive ranks (replicated). Any other
size cannot hold the model's KV and is refused by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's `structured_outputs` (exactly one is set):

    - json: a JSON schema (a dict, or its JSON text); the output is one JSON value of it
    - json_object: any JSON object
    - regex: the output matches the regular expression
    - choice: the output is one of these strings
    - grammar: the output derives from this EBNF grammar (GBNF: `root ::= ...`)

    The schema is kept as JSON text, in the order given (properties are generated in the
    schema's order), so that the value travels on the wire and keys a cache of compiled
    grammars. Nothing is compiled here: nodes compile with xgrammar and answer a grammar that
    does not compile as a bad request.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _schema_text(self.json))
        elif isinstance(self.json, str):
            _schema_text(_parse_schema(self.json))
        if self.choice is not None:
            choice = tuple(self.choice)
            _check(bool(choice), "structured_outputs.choice", "must list at least one string")
            _check(
                all(isinstance(c, str) and c for c in choice),
                "structured_outputs.choice",
                "must hold non-empty strings",
            )
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), name, "is empty")
        given = [n for n in _CONSTRAINTS if getattr(self, n) not in (None, False)]
        _check(
            len(given) == 1,
            "structured_outputs",
            f"must set exactly one of {', '.join(_CONSTRAINTS)} (got {', '.join(given) or 'none'})",
        )

    @property
    def kind(self) -> str:
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """What a compiled grammar is cached under (with the tokenizer's identity)."""
        return self.kind, getattr(self, self.kind)


def _parse_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None


def _schema_text(schema: Any) -> str:
    if not isinstance(schema, dict | bool):
        raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM/OpenAI.

    temperature 0 means greedy. logprobs=N returns the chosen token's logprob and the top N
    (0: only the chosen one; None: none). Logprobs are those of the raw model distribution,
    before temperature or truncation, like vLLM's default.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    # The logprob of every prompt token after the first and the top N at its position (0:
    # only the prompt's own token); computed while the prompt is prefilled, so a request
    # that asks skips the prefix cache.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(
            self.max_tokens >= 1 or (self.scores_prompt_only and self.prompt_logprobs is not None),
            "max_tokens",
            "must be at least 1 (0 only scores a prompt: it needs echo or prompt_logprobs)",
        )
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        _check(self.temperature >= 0.0, "temperature", "must be non-negative")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be -1, 0 (off) or positive")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be 0..20")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            "must be 0..20",
        )

    @property
    def scores_prompt_only(self) -> bool:
        """max_tokens 0: the request only scores its prompt (prompt_logprobs, vLLM's `echo`);
        nothing is generated, no KV goes to a decode node."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} {what}")


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the top alternatives, for one generated position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # of token_id in its distribution (1: the most likely); 0 when not computed


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The token a prefill node sampled at the prompt's end, handed to the decode node with the
    prompt's KV (the transfer's done message): the decode node goes on from it."""

    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class SpecDecodeCounts:
    """A node's speculative-decoding counters since it started (vLLM's `spec_decode_*`), as
    its heartbeats carry them for the router to sum over nodes."""

    num_drafts: int  # verify steps of a request that had drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...] = ()  # accepted drafts by draft position


@dataclass(frozen=True, slots=True)
class TierCounts:
    """One KV tier's counters on one node since it started (`kv_store.TierStats` and the
    cost model's choices), as its heartbeats carry them for the router to sum over nodes."""

    tier: str  # its kind: host, file, redis
    hits: int = 0
    misses: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_seconds: float = 0.0
    errors: int = 0
    bad_objects: int = 0
    recompute_chosen: int = 0  # blocks recomputed because loading was judged slower


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Seconds one request spent in each stage on one node, each the difference of two readings
    of that node's own monotonic clock (clocks of two processes are never compared; the router
    stitches the stages). A stage that did not run on the node is 0. A node computing a prompt
    sends queue and prefill with the request's first token; a decode node that received the
    prompt's KV sends the rest with its first token."""

    queue: float = 0.0  # taken -> the first step that ran it
    prefill: float = 0.0  # that step -> the first token left the node
    kv_transfer: float = 0.0  # decode node: blocks reserved -> the KV whole on every rank
    admission: float = 0.0  # decode node: KV whole -> the first step that ran it
    first_step: float = 0.0  # decode node: that step -> its first token left the node


# Element sizes of the cache dtypes a connector can carry; names are torch's attribute names.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


# Bumped whenever the canonical encoding below changes, so old and new digests never collide.
_DIGEST_SCHEMA = "pdserve-kv-layout/1"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a KV page means: model, cache dtype and the geometry of one layer's cache.

    A layer cache is `[planes, num_blocks, block_size, num_kv_heads, head_dim]`: planes 2 holds
    K at [0] and V at [1] per KV head; planes 1 holds one latent per token (MLA: one "head" of
    kv_lora_rank + rope dimensions, the same on every tensor-parallel rank). `num_blocks` is a
    per-node choice and deliberately not part of the layout.
    """

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    planes: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError("KVLayout.model_id must be a non-empty string")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.planes not in (1, 2) or isinstance(self.planes, bool):
            raise ValueError(
                f"KVLayout.planes must be 1 (a latent) or 2 (K and V), not {self.planes!r}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, every plane together."""
        return self.planes * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer."""
        return self.num_layers * self.page_bytes

    def page_shape(self, n_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of `n_blocks` gathered pages of one layer."""
        return (self.planes, n_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> KVLayout:
        """Build from a wire map; ValueError on unknown, missing or ill-typed fields (`planes`
        may be left out: 2, as a node from before latent caches sends it)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(body, dict) or not names - {"planes"} <= set(body) <= names:
            raise ValueError(f"a KV layout needs exactly the fields {sorted(names)}")
        return cls(**body)

    def digest(self) -> str:
        """sha256 hex of a canonical encoding (sorted keys, fixed separators, schema tag).
        `planes` enters only when it is not 2, so a K/V layout's digest is what it was before
        latent caches existed (nodes of both versions still pair)."""
        fields = self.to_dict()
        if fields["planes"] == 2:
            del fields["planes"]
        canonical = json.dumps(
            {"schema": _DIGEST_SCHEMA, **fields}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def describe_mismatch(
        self, other: KVLayout, labels: tuple[str, str] = ("this", "other")
    ) -> str:
        """One line naming every field that differs with both values; "" when equal."""
        diffs = [
            f"{f.name}: {labels[0]} {getattr(self, f.name)!r} != {labels[1]} "
            f"{getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        groups = (_page_group(self.model_id), _page_group(other.model_id))
        if groups[0] != groups[1]:  # a drafter's pages on one side only, or another's
            diffs.append(
                f"speculative_config: {labels[0]} {groups[0]}, {labels[1]} {groups[1]} "
                "(run both nodes with the same --speculative-config method and draft model)"
            )
        return "KV layout mismatch: " + "; ".join(diffs) if diffs else ""


def _page_group(model_id: str) -> str:
    """What a layout's model id says of a drafter's page group after the target's
    (`ModelRunner.kv_layout` appends "+draft:<fingerprint>" or "+mtp")."""
    _, plus, group = model_id.partition("+")
    return f"has the page group {group!r}" if plus else "has no draft page group"


# -- the KV heads across tensor-parallel ranks -------------------------------------------------


def check_kv_split(num_kv_heads: int, size: int) -> None:
    """ValueError naming both numbers when `size` ranks cannot hold `num_kv_heads` heads."""
    if size < 1:
        raise ValueError(f"a tensor-parallel group needs at least one rank, got {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} KV heads do not split across {size} ranks (nor replicate: "
            f"{size} is not a multiple of {num_kv_heads})"
        )


def rank_kv_heads(num_kv_heads: int, size: int, rank: int) -> range:
    """The model's KV heads that rank `rank` of `size` holds."""
    check_kv_split(num_kv_heads, size)
    if size <= num_kv_heads:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    first = rank // (size // num_kv_heads)
    return range(first, first + 1)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One sending rank's share of one receiving rank's KV: the model's heads
    [first, first + count), found at `src_offset` among the sender's heads and written at
    `dst_offset` among the receiver's."""

    src_rank: int
    dst_rank: int
    first: int
    count: int
    src_offset: int
    dst_offset: int


def transfer_plan(num_kv_heads: int, send_tp: int, recv_tp: int) -> tuple[HeadSlice, ...]:
    """Every slice a group at TP `send_tp` sends to one at TP `recv_tp`: each receiving rank
    gets each of its heads exactly once. Where several senders hold a head (replicated), the
    receivers spread over them (receiver j reads from holder j mod holders)."""
    check_kv_split(num_kv_heads, send_tp)
    check_kv_split(num_kv_heads, recv_tp)
    senders = [rank_kv_heads(num_kv_heads, send_tp, i) for i in range(send_tp)]
    plan: list[HeadSlice] = []
    for dst in range(recv_tp):
        held = rank_kv_heads(num_kv_heads, recv_tp, dst)
        for head in held:
            holders = [i for i, heads in enumerate(senders) if head in heads]
            src = holders[dst % len(holders)]
            last = plan[-1] if plan else None
            if (
                last
                and (last.dst_rank, last.src_rank) == (dst, src)
                and (last.first + last.count == head)
            ):
                plan[-1] = HeadSlice(
                    src, dst, last.first, last.count + 1, last.src_offset, last.dst_offset
                )
            else:
                offsets = (head - senders[src].start, head - held.start)
                plan.append(HeadSlice(src, dst, head, 1, *offsets))
    return tuple(plan)

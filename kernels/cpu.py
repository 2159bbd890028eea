"""The CPU kernels: everything the serving path runs when tensors live on the CPU.

`store_kv` writes new K/V rows into their cache slots; `gather_pages` and `scatter_pages` copy
blocks out of and into a layer cache for KV transfer. All three are plain torch on any device,
so they are also the oracles of their Triton kernels. Shapes are those of `reference.py`.

Paged attention reads the cache where it lies, a chunk of blocks at a time. The reference
(`reference.paged_attention_ref`) gathers every sequence's whole context into new tensors per
layer. Here each group of sequences walks its block table in chunks of about CHUNK_BYTES of K:
the chunk's blocks are copied into a buffer of a few MiB, reused by every chunk and layer of the
step; one flash-attention call (`aten::_scaled_dot_product_flash_attention_for_cpu`, which also
returns the log-sum-exp) attends over it, and the chunks' partial outputs are merged by their
log-sum-exps (an online softmax). Grouped-query heads fold into the query length: the G query
heads that share a KV head are G query rows over the same keys, so K/V are never repeated.

Decode rows (one query each) go to `cpu_attention.paged_decode` instead where it serves the
dtypes: one C++ call a layer for all of them, reading each row's blocks in place with an online
softmax (no gather, no flash call per group). So do a verify step's rows (a sequence of up to
ROW_QUERIES queries, one kernel row, causal among them) at any length, and the queries of a
prefill chunk whose sequence has at most IN_PLACE_KEYS keys, each query a row of its own length
(its position + 1); longer prefill chunks keep the flash path above.

What a step's metadata implies (groups, gather indices, masks, buffers, the decode rows) is a
`StepPlan`, made by the first layer and cached on the metadata's `seq_lens` tensor, which every
layer of the step gets (the compiled decode passes the same tensor objects into its opaque op).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels import cpu_attention

# A chunk gathers up to CHUNK_BYTES of K across its rows, yet at least MIN_CHUNK_KEYS keys a
# row: each chunk costs a dozen torch calls (each a parallel region whose barrier stalls when
# another process holds a core) and flash works in key blocks of 512, so short chunks lose
# more than the buffer's cache residence wins.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_KEYS = 1024
# A prefill chunk whose sequence has at most this many keys goes to the in-place kernel, one
# row per query, instead of flash: the flash kernel computes the whole masked square at ~20
# GMAC/s, the kernel only each row's keys. One layer, SmolLM2's heads, bf16, one thread
# (docs/quantization.md, "Where 16 requests' time goes"): 32 keys 84 against 172 us, 96
# 416/577, 160 1212/1488, 224 2714/2903, 288 5526/4195.
IN_PLACE_KEYS = 192
# A sequence with at most this many queries (a verify step's 1 + k, a decode row) goes to the
# in-place kernel whatever its length, its queries one kernel row that reads its blocks once.
ROW_QUERIES = 8
_NEG = -1e30  # the log-sum-exp of a query that sees no key in a chunk: merges to weight 0
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot; a negative slot means "do not store"."""
    num_blocks, block_size = k_cache.shape[:2]
    slots = slot_mapping.long()
    if cpu_attention.stores(key, value, k_cache):  # one C++ call, not a dozen dispatches
        return cpu_attention.store_kv(key, value, k_cache, v_cache, slots)
    if not bool((slots >= 0).all()):  # the boolean selection only when some are skipped
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def decode_groups(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """The decode rows (q_len 1) in groups, longest first, each row at least half as long as
    its group's longest: padding every row to its group's longest at most doubles the work."""
    rows = sorted((b for b, q_len in enumerate(q_lens) if q_len == 1), key=lambda b: -seq_lens[b])
    groups: list[list[int]] = []
    for b in rows:
        if groups and 2 * seq_lens[b] >= seq_lens[groups[-1][0]]:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def gather_pages(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy the given blocks of one layer's cache [P, N, block_size, H, D] (P planes: 2 for K
    and V, 1 for a latent) into a contiguous [P, n, block_size, H, D], new or `out` (which must
    have exactly that shape, the cache's dtype and be contiguous)."""
    if out is None:
        return layer_cache.index_select(1, block_ids.long())
    check_pages_out(out, layer_cache, block_ids)
    return torch.index_select(layer_cache, 1, block_ids.long(), out=out)


def scatter_pages(layer_cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor):
    """Write contiguous pages [P, n, block_size, H, D] into the given blocks of a layer cache
    [P, N, block_size, H, D]."""
    layer_cache.index_copy_(1, block_ids.long(), pages.to(layer_cache.dtype))


def check_pages_out(out: torch.Tensor, layer_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """ValueError unless `out` can take the gathered pages of `block_ids` as they are (no
    resize, no cast): shared by both gathers so an `out=` is refused the same way."""
    shape = (layer_cache.shape[0], block_ids.shape[0], *layer_cache.shape[2:])
    if tuple(out.shape) != shape or out.dtype != layer_cache.dtype:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} cannot take pages {shape} {layer_cache.dtype}"
        )
    if not out.is_contiguous() or out.device != layer_cache.device:
        raise ValueError(f"out must be contiguous and on {layer_cache.device}")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One flash call: the group's first `rows` rows over `blocks` blocks of keys each.

    index:  [rows * blocks] physical blocks, row-major (padding entries point at block 0)
    first:  position of the chunk's first key (the same for every row)
    seen:   [rows, q_len, blocks * block_size] True where a query sees a key; None when
            every query sees every key of the chunk
    unseen: rows of the gathered [rows * keys] no query sees (they may hold NaN): zeroed
    empty:  [rows, q_len] True for a query that sees no key here, or None
    """

    index: torch.Tensor
    rows: int
    blocks: int
    first: int
    seen: torch.Tensor | None
    unseen: torch.Tensor | None
    empty: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Group:
    """Sequences with the same query length, longest first; tokens [n * q_len] are their rows
    of the flat query, sequence-major. A decode group's rows are within 2x of its longest
    (`decode_groups`); a prefill chunk is a group of its own."""

    tokens: torch.Tensor
    n: int
    q_len: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The step's query rows for the in-place kernel (decode and verify sequences, short prefill
    chunks' queries): their rows of the flat query (None: every row of the step, in order) with
    the kernel rows' block tables [R, W], lengths [R] (a row's last position + 1) and queries
    [R] (None: one each), int32."""

    tokens: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    queries: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step's groups, its decode rows when the in-place kernel takes them (then no group
    holds them), and what its layers' calls share: masks in the query's dtype and the gather
    buffers, made by the first layer that needs them (`cache`)."""

    key: tuple
    groups: tuple[Group, ...]
    decode: DecodeRows | None = None
    cache: dict = field(default_factory=dict)

    def mask(self, chunk: Chunk, heads_per_kv: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The chunk's additive mask [rows, 1, G * q_len, keys] (G query heads per KV head)."""
        if chunk.seen is None:
            return None
        key = ("mask", id(chunk), heads_per_kv, dtype)
        if key not in self.cache:
            add = torch.zeros(chunk.seen.shape, dtype=dtype).masked_fill_(~chunk.seen, -torch.inf)
            self.cache[key] = add[:, None].repeat(1, 1, heads_per_kv, 1)
        return self.cache[key]

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A gather buffer reused by every layer of the step (a fresh multi-megabyte tensor per
        call costs more in page faults than the copy into it)."""
        numel = int(torch.Size(shape).numel())
        key = (name, like.dtype, torch.is_inference_mode_enabled())
        buf = self.cache.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.cache[key] = like.new_empty(numel)
        return buf[:numel].view(shape)


def _sees_all(lo: int, hi: int, seq_len: int, q_len: int, window: int | None) -> bool:
    """Whether every query of a sequence sees every key in [lo, hi): its earliest query all
    of them (causal), its latest the first of them (window). Decided on the host, the chunks
    inside a context build no mask."""
    return hi <= seq_len - q_len + 1 and (window is None or lo > seq_len - 1 - window)


def _chunk(
    rows: list[int],
    blocks: range,
    lens: list[int],
    q_len: int,
    block_tables: torch.Tensor,
    block_size: int,
    window: int | None,
) -> Chunk:
    """The chunk of block columns `blocks` for the sequences `rows` (each owning some)."""
    keys = len(blocks) * block_size
    first = blocks.start * block_size
    lens_t = torch.tensor([lens[b] for b in rows])
    table = block_tables[torch.tensor(rows), blocks.start : blocks.stop].long()
    owned = torch.arange(blocks.start, blocks.stop)[None, :] * block_size < lens_t[:, None]
    index = torch.where(owned, table, 0).flatten()
    if all(_sees_all(first, first + keys, lens[b], q_len, window) for b in rows):
        return Chunk(index, len(rows), len(blocks), first, None, None, None)
    k_pos = first + torch.arange(keys)[None, None, :]
    q_pos = (lens_t[:, None] - q_len + torch.arange(q_len)[None, :])[:, :, None]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    if bool(seen.all()):
        return Chunk(index, len(rows), len(blocks), first, None, None, None)
    unseen = (~seen.any(dim=1)).flatten().nonzero().flatten()
    empty = ~seen.any(dim=2)
    return Chunk(
        index,
        len(rows),
        len(blocks),
        first,
        seen,
        unseen if unseen.numel() else None,
        empty if bool(empty.any()) else None,
    )


def _group(
    rows: list[int],
    starts: list[int],
    lens: list[int],
    q_len: int,
    block_tables: torch.Tensor,
    block_size: int,
    window: int | None,
    token_bytes: int,
) -> Group:
    """Rows sorted longest first, their block columns cut into chunks of ~CHUNK_BYTES."""
    rows = sorted(rows, key=lambda b: -lens[b])
    first_pos = min(lens[b] - q_len for b in rows)  # the earliest query of the group
    lo = 0 if window is None else max(0, first_pos - window + 1) // block_size
    hi = -(-lens[rows[0]] // block_size)
    least = max(1, min(MIN_CHUNK_KEYS, CHUNK_BYTES // token_bytes) // block_size)
    step = max(least, CHUNK_BYTES // (token_bytes * block_size * len(rows)))
    chunks = []
    for c0 in range(lo, hi, step):
        live = [b for b in rows if lens[b] > c0 * block_size]  # a prefix: longest first
        blocks = range(c0, min(hi, c0 + step))
        chunks.append(_chunk(live, blocks, lens, q_len, block_tables, block_size, window))
    tokens = torch.tensor([starts[b] + i for b in rows for i in range(q_len)])
    return Group(tokens, len(rows), q_len, tuple(chunks))


def make_plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    window: int | None,
    token_bytes: int,
    in_place: bool = False,
) -> tuple[Group, ...]:
    """The step's groups: decode rows batched by length, each longer query on its own; none
    for the rows the in-place kernel takes where `in_place` (`decode_rows`)."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    args = (starts, lens)
    rest = (block_tables, block_size, window, token_bytes)
    decodes = [] if in_place else decode_groups(q_lens, lens)
    groups = [_group(g, *args, 1, *rest) for g in decodes]
    prefills = [
        b for b, q in enumerate(q_lens) if q > 1 and not (in_place and kernel_takes(q, lens[b]))
    ]
    groups += [_group([b], *args, q_lens[b], *rest) for b in prefills]
    return tuple(groups)


def kernel_takes(q_len: int, seq_len: int) -> bool:
    """Whether a sequence's queries go to the in-place kernel: at most ROW_QUERIES of them (a
    decode row, a verify step's), or a prefill chunk of a sequence with at most IN_PLACE_KEYS
    keys."""
    return q_len <= ROW_QUERIES or seq_len <= IN_PLACE_KEYS


def _kernel_rows(q_len: int, seq_len: int) -> list[tuple[int, int]]:
    """A taken sequence's kernel rows as (queries, length): one row of all its queries where
    they are few, else a row per query of its own length (a causal square row by row does a
    half of the work one row of them all would); none for a sequence without queries."""
    if 1 <= q_len <= ROW_QUERIES:
        return [(q_len, seq_len)]
    return [(1, seq_len - q_len + i + 1) for i in range(q_len)]


def decode_rows(
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
) -> DecodeRows | None:
    """The query rows the in-place kernel takes this step (`kernel_takes`), or None: a decode or
    verify sequence one row of its queries, a short prefill chunk's queries each a row with its
    sequence's block table and its own length. A step of decodes only passes its tensors as
    they are."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    seqs = [b for b, q in enumerate(q_lens) if kernel_takes(q, lens[b])]
    if not seqs:
        return None
    tables = block_tables.int().contiguous()
    if len(seqs) == len(lens) and all(q == 1 for q in q_lens):
        return DecodeRows(None, tables, seq_lens.int().contiguous())
    rows = [(b, *row) for b in seqs for row in _kernel_rows(q_lens[b], lens[b])]
    tokens = (
        None if len(seqs) == len(lens) else [starts[b] + i for b in seqs for i in range(q_lens[b])]
    )
    queries = [n for _, n, _ in rows]
    return DecodeRows(
        None if tokens is None else torch.tensor(tokens),
        tables.index_select(0, torch.tensor([b for b, _, _ in rows], dtype=torch.long)),
        torch.tensor([n for _, _, n in rows], dtype=torch.int32),
        None if all(n == 1 for n in queries) else torch.tensor(queries, dtype=torch.int32),
    )


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    # Inference tensors have no version counter (and cannot be changed outside inference mode).
    return tuple(-1 if t.is_inference() else t._version for t in tensors)


def step_plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    window: int | None,
    token_bytes: int,
    in_place: bool = False,
) -> StepPlan:
    """The plan cached on seq_lens when it was made from these very tensors, unchanged (the
    layers of a step), else a new one cached there. One per layer kind: models that alternate
    sliding-window and full layers keep both. `in_place`: decode rows go to the kernel."""
    inputs = (block_tables, query_start_loc, seq_lens)
    kind = (block_size, window, token_bytes, in_place)
    key = (*map(id, inputs), *_versions(inputs))
    plans = getattr(seq_lens, "_pdserve_plans", None)
    if plans is None or plans.get("key") != key:
        # Holding the other two keeps their ids from being reused while the plans live on
        # seq_lens (holding seq_lens itself would make a cycle).
        plans = seq_lens._pdserve_plans = {"key": key, "inputs": inputs[:2]}
    if kind not in plans:
        decode = decode_rows(*inputs) if in_place else None
        plans[kind] = StepPlan(kind, make_plan(*inputs, *kind), decode)
    return plans[kind]


def _fold(rows: torch.Tensor, n: int, q_len: int, kv_heads: int) -> torch.Tensor:
    """Query rows [n * q_len, H, D] -> [n, Hkv, G * q_len, D], g-major within a KV head."""
    heads, dim = rows.shape[1:]
    g = heads // kv_heads
    x = rows.view(n, q_len, kv_heads, g, dim).permute(0, 2, 3, 1, 4)
    return x.reshape(n, kv_heads, g * q_len, dim)


def _unfold(out: torch.Tensor, q_len: int, heads: int) -> torch.Tensor:
    """The inverse of `_fold`: [n, Hkv, G * q_len, D] -> [n * q_len, H, D]."""
    n, kv_heads, _, dim = out.shape
    x = out.view(n, kv_heads, heads // kv_heads, q_len, dim).permute(0, 3, 1, 2, 4)
    return x.reshape(n * q_len, heads, dim)


def _gather(cache: torch.Tensor, chunk: Chunk, plan: StepPlan, name: str) -> torch.Tensor:
    """The chunk's K (or V) [rows, Hkv, keys, D] in the plan's buffer `name`, rows no query
    sees zeroed (masked to weight 0, yet NaN * 0 is NaN)."""
    block_size, kv_heads, dim = cache.shape[1:]
    buf = plan.buffer(name, (chunk.index.shape[0], block_size, kv_heads, dim), cache)
    torch.index_select(cache, 0, chunk.index, out=buf)
    if chunk.unseen is not None:
        buf.view(-1, kv_heads, dim).index_fill_(0, chunk.unseen, 0.0)
    return buf.view(chunk.rows, -1, kv_heads, dim).transpose(1, 2)


def _empty_fix(plan: StepPlan, chunk: Chunk, heads_per_kv: int) -> torch.Tensor:
    """[rows, 1, G * q_len] True for the folded queries that see no key in the chunk."""
    key = ("empty", id(chunk), heads_per_kv)
    if key not in plan.cache:
        plan.cache[key] = chunk.empty.repeat(1, heads_per_kv)[:, None]
    return plan.cache[key]


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: Chunk,
    plan: StepPlan,
    scale: float,
    g: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folded queries [rows, Hkv, M, D] over the chunk's keys: output [rows, Hkv, M, D] (the
    query's dtype) and log-sum-exp [rows, Hkv, M] (float32, _NEG where no key is seen)."""
    k = _gather(k_cache, chunk, plan, "k").to(q.dtype)
    v = k if v_cache is k_cache else _gather(v_cache, chunk, plan, "v").to(q.dtype)
    mask = plan.mask(chunk, g, q.dtype)
    out, lse = _flash(q, k, v, attn_mask=mask, scale=scale)
    if chunk.empty is not None:
        lse = lse.masked_fill(_empty_fix(plan, chunk, g), _NEG)
    return out, lse


def _merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, part_lse: torch.Tensor):
    """Fold one chunk's (out, part_lse) into the running (acc, lse), in place: each side
    weighted by its share of the softmax over both (`combine_splits_ref`, two at a time)."""
    total = torch.logaddexp(lse, part_lse)
    acc.mul_(torch.exp(lse - total)[..., None]).add_(out * torch.exp(part_lse - total)[..., None])
    lse.copy_(total)


def _attend_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: Group,
    plan: StepPlan,
    scale: float,
) -> torch.Tensor:
    """The group's output rows [n * q_len, H, D], chunk by chunk (the first has every row)."""
    kv_heads = k_cache.shape[2]
    g = query.shape[1] // kv_heads
    q = _fold(query.index_select(0, group.tokens), group.n, group.q_len, kv_heads)
    acc, lse = _attend_chunk(q, k_cache, v_cache, group.chunks[0], plan, scale, g)
    if len(group.chunks) > 1:
        acc = acc.float()
    for chunk in group.chunks[1:]:
        out, part_lse = _attend_chunk(q[: chunk.rows], k_cache, v_cache, chunk, plan, scale, g)
        _merge(acc[: chunk.rows], lse[: chunk.rows], out, part_lse)
    return _unfold(acc, group.q_len, query.shape[1])


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """`reference.paged_attention_ref`'s semantics (shapes there), reading the paged cache a
    chunk of blocks at a time, decode rows in place (`cpu_attention`) where that serves and
    `decode_kernel` (False: flash for them too, the bench's before); the step's plan is made
    by its first layer. v_cache may be k_cache itself (an MLA latent: keys and values from
    one read; the caller keeps the value dims of the output)."""
    block_size, kv_heads, dim = k_cache.shape[1:]
    token_bytes = kv_heads * dim * k_cache.element_size()
    in_place = decode_kernel and cpu_attention.serves(query, k_cache, v_cache)
    args = (block_tables, query_start_loc, seq_lens, block_size, sliding_window, token_bytes)
    plan = step_plan(*args, in_place)
    decoded = None if plan.decode is None else _attend_decode(query, k_cache, v_cache, plan, scale)
    if decoded is not None and plan.decode.tokens is None:
        return decoded  # decodes only: the kernel's output is the step's
    out = torch.empty_like(query)
    if decoded is not None:
        out.index_copy_(0, plan.decode.tokens, decoded)
    for group in plan.groups:
        rows = _attend_group(query, k_cache, v_cache, group, plan, scale)
        out.index_copy_(0, group.tokens, rows.to(out.dtype))
    return out


def _attend_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float
) -> torch.Tensor:
    """The decode rows' outputs [R, H, D], the plan's kernel call."""
    rows, window = plan.decode, plan.key[1]
    q = query if rows.tokens is None else query.index_select(0, rows.tokens)
    return cpu_attention.paged_decode(
        q, k_cache, v_cache, rows.block_tables, rows.seq_lens, scale, window, None, rows.queries
    )

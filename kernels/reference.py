"""Pure-torch references of every kernel: the CPU serving path and the oracle for Triton tests.

Shapes used throughout:
  key/value rows      [T, num_kv_heads, head_dim]
  one cache half      [num_blocks, block_size, num_kv_heads, head_dim]  (K or V of one layer)
  layer cache         [2, num_blocks, block_size, num_kv_heads, head_dim]
  query               [T, num_heads, head_dim]
  block_tables        [B, max_blocks_per_seq] int32 (padding entries are never read)
  query_start_loc     [B + 1] int32, cumulative query lengths
  seq_lens            [B] int32, context length of each sequence *including* its new tokens
"""

from __future__ import annotations

import math
import threading

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot; a negative slot means "do not store"."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


class _Scratch(threading.local):
    """Reused buffers for the K/V gathers of attention, one set per thread.

    A fresh multi-megabyte tensor per gather and layer costs more in page faults than the
    copy itself (about 4x on CPU), so each named buffer is kept and grown as needed, up to
    MAX_BYTES; a gather larger than that gets a tensor of its own.
    """

    MAX_BYTES = 256 << 20

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        if numel * like.element_size() > self.MAX_BYTES:
            return like.new_empty(shape)
        # Tensors made under inference mode cannot be written outside it: one set per mode.
        key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[key] = like.new_empty(numel)
        return buf[:numel].view(shape)


_SCRATCH = _Scratch()


def _gather_rows(
    cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, name: str
) -> torch.Tensor:
    """Rows 0..max(lens) of each sequence's K (or V) through its block table, in whole blocks:
    [n, blocks * block_size, Hkv, D], in this thread's scratch buffer `name` (valid until the
    next gather into it). Entries past a sequence's last block are never followed (block 0
    stands in), so table padding may hold anything."""
    block_size = cache.shape[1]
    n_blocks = (int(lens.max()) + block_size - 1) // block_size
    tables = tables[:, :n_blocks].long()
    owned = torch.arange(n_blocks, device=tables.device)[None, :] * block_size < lens[:, None]
    index = torch.where(owned, tables, 0).flatten()
    out = _SCRATCH.take(name, (index.shape[0], *cache.shape[1:]), cache)
    torch.index_select(cache, 0, index, out=out)
    return out.view(tables.shape[0], n_blocks * block_size, *cache.shape[2:])


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of n sequences in float32 (one SDPA call, K/V not repeated).

    q [n, q_len, H, D], k/v [n, L, Hkv, D], seen [n, q_len, L] (True: the query sees the key;
    None: plain causal with q_len == L, which lets SDPA skip the masked half) ->
    [n, q_len, H, D] float32. Query head h reads K/V head h // (H // Hkv). Every query must
    see at least one key; keys no query sees may hold anything, NaN included. k and v are
    scratch (the callers' own gathered copies, contiguous): unseen rows are zeroed in place.
    """
    n, length = k.shape[:2]
    k, v = k.float(), v.float()
    unseen = None if seen is None else ~seen.any(dim=1).flatten()
    if unseen is not None and unseen.any():
        # Masked to weight 0, yet NaN * 0 is NaN: zero those keys and values.
        rows = unseen.nonzero().flatten()
        for t in (k, v):
            t.view(n * length, *t.shape[2:]).index_fill_(0, rows, 0.0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if seen is None else seen[:, None],
        is_causal=seen is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _seen_keys(q_pos: torch.Tensor, key_len: int, sliding_window: int | None) -> torch.Tensor:
    """[n, q_len, key_len] True where the query at position q_pos[i, j] sees key position k:
    k <= q_pos, and with a window w, also k > q_pos - w."""
    k_pos = torch.arange(key_len, device=q_pos.device)[None, None, :]
    q_pos = q_pos[:, :, None]
    seen = k_pos <= q_pos
    if sliding_window is not None:
        seen &= k_pos > q_pos - sliding_window
    return seen


def _decode_groups(q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
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


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new query tokens over each sequence's paged K/V.

    Query i of a sequence with q_len new tokens sits at position seq_len - q_len + i and sees
    keys 0..position (and, with a sliding window w, only the last w of them). Serves prefill
    chunks with a cached prefix and decode (q_len == 1) alike. Accumulates in float32.

    Decode rows (one new token each) go through in batched calls, each padded to its longest
    row (rows are grouped by length so padding never doubles a group's work); each longer query
    runs on its own, since its matmuls already fill the machine.
    """
    out = torch.empty_like(query)
    dev = query.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    for group in _decode_groups(q_lens, lens):
        rows = torch.tensor(group, device=dev)
        tokens = torch.tensor([starts[b] for b in group], device=dev)
        dec_lens = torch.tensor([lens[b] for b in group], device=dev)
        k = _gather_rows(k_cache, block_tables[rows], dec_lens, "k")
        v = _gather_rows(v_cache, block_tables[rows], dec_lens, "v")
        seen = _seen_keys((dec_lens - 1)[:, None], k.shape[1], sliding_window)
        out[tokens] = _attend(query[tokens][:, None], k, v, seen, scale)[:, 0].to(out.dtype)
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len = lens[b]
        length = torch.tensor([seq_len], device=dev)
        k = _gather_rows(k_cache, block_tables[b : b + 1], length, "k")[:, :seq_len]
        v = _gather_rows(v_cache, block_tables[b : b + 1], length, "v")[:, :seq_len]
        seen = None  # a whole prompt, no window: plain causal
        if q_len < seq_len or sliding_window is not None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)[None]
            seen = _seen_keys(q_pos, seq_len, sliding_window)
        q = query[starts[b] : starts[b + 1]][None]
        out[starts[b] : starts[b + 1]] = _attend(q, k, v, seen, scale)[0].to(out.dtype)
    return out


def gather_pages_ref(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy the given blocks of one layer's cache into a contiguous [2, n, block_size, H, D],
    new or `out` (which must have exactly that shape, the cache's dtype and be contiguous)."""
    if out is None:
        return layer_cache.index_select(1, block_ids.long())
    check_pages_out(out, layer_cache, block_ids)
    return torch.index_select(layer_cache, 1, block_ids.long(), out=out)


def scatter_pages_ref(layer_cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor):
    """Write contiguous pages [2, n, block_size, H, D] into the given blocks of a layer cache."""
    layer_cache.index_copy_(1, block_ids.long(), pages.to(layer_cache.dtype))


def check_pages_out(out: torch.Tensor, layer_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """ValueError unless `out` can take the gathered pages of `block_ids` as they are (no
    resize, no cast): shared by both gathers so an `out=` is refused the same way."""
    shape = (2, block_ids.shape[0], *layer_cache.shape[2:])
    if tuple(out.shape) != shape or out.dtype != layer_cache.dtype:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} cannot take pages {shape} {layer_cache.dtype}"
        )
    if not out.is_contiguous() or out.device != layer_cache.device:
        raise ValueError(f"out must be contiguous and on {layer_cache.device}")

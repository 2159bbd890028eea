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


def _gather_context(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len rows of one sequence's K (or V): [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_row[:n_blocks].long())
    return blocks.reshape(n_blocks * block_size, *cache.shape[2:])[:seq_len]


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
    """
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q = query[starts[b] : starts[b + 1]].float()
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[b], seq_len).float()
        v = _gather_context(v_cache, block_tables[b], seq_len).float()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = k_pos > q_pos
        if sliding_window is not None:
            mask |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
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

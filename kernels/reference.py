"""Pure-torch references: the oracles the kernel tests compare against, and what `ops` runs on a
device other than the CPU that has no Triton. (store_kv and the page copies have no entry here:
the CPU kernels in `cpu.py` are plain torch and serve as their references.)

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import decode_groups


@dataclass(frozen=True, slots=True)
class _Part:
    """One SDPA call's worth of a step: n sequences with q_len query tokens each.

    tokens:  [n * q_len] rows of the flat query (and output), sequence-major
    index:   [n * blocks] the blocks to gather, each sequence's padded to the part's longest
             (entries past a sequence's last block point at block 0: never read as context)
    seen:    [n, q_len, blocks * block_size] True where a query sees a key; None: plain causal
             over a whole prompt (q_len == keys), which SDPA does without a mask
    unseen:  flat rows of the gathered keys that no query sees (they may hold NaN), or None
    keys:    keys per sequence actually attended (the gather's rows past it are cut off)
    """

    tokens: torch.Tensor
    index: torch.Tensor
    seen: torch.Tensor | None
    unseen: torch.Tensor | None
    n: int
    q_len: int
    keys: int


def _make_part(
    seqs: list[int],
    starts: list[int],
    seq_lens: list[int],
    q_len: int,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> _Part:
    """The part for sequences `seqs`, all with q_len new tokens (the last q_len positions)."""
    dev = block_tables.device
    n_blocks = (max(seq_lens[b] for b in seqs) + block_size - 1) // block_size
    lens = torch.tensor([seq_lens[b] for b in seqs], device=dev)
    tables = block_tables[torch.tensor(seqs, device=dev), :n_blocks].long()
    owned = torch.arange(n_blocks, device=dev)[None, :] * block_size < lens[:, None]
    index = torch.where(owned, tables, 0).flatten()
    tokens = torch.tensor([starts[b] + i for b in seqs for i in range(q_len)], device=dev)
    keys = n_blocks * block_size if len(seqs) > 1 else seq_lens[seqs[0]]
    seen = unseen = None
    if len(seqs) > 1 or q_len < keys or sliding_window is not None:
        k_pos = torch.arange(keys, device=dev)[None, None, :]
        q_pos = (lens[:, None] - q_len + torch.arange(q_len, device=dev)[None, :])[:, :, None]
        seen = k_pos <= q_pos
        if sliding_window is not None:
            seen &= k_pos > q_pos - sliding_window
        rows = (~seen.any(dim=1)).flatten().nonzero().flatten()
        unseen = rows if rows.numel() else None
    return _Part(tokens, index, seen, unseen, len(seqs), q_len, keys)


def _parts(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> list[_Part]:
    """The step's SDPA calls: one per group of decodes of like length, one per prompt chunk.
    Made anew at every call: an oracle keeps no state between calls."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    parts = [
        _make_part(group, starts, lens, 1, block_tables, block_size, sliding_window)
        for group in decode_groups(q_lens, lens)
    ]
    parts += [
        _make_part([b], starts, lens, q_len, block_tables, block_size, sliding_window)
        for b, q_len in enumerate(q_lens)
        if q_len > 1
    ]
    return parts


def _gather(cache: torch.Tensor, part: _Part) -> torch.Tensor:
    """The part's K (or V) rows [n, keys, Hkv, D] copied from the paged cache, unseen rows
    zeroed."""
    out = cache.index_select(0, part.index)
    rows = out.view(part.n, -1, *cache.shape[2:])[:, : part.keys]
    if part.unseen is not None:
        # Masked to weight 0, yet NaN * 0 is NaN: zero the keys and values no query sees.
        rows.view(-1, *cache.shape[2:]).index_fill_(0, part.unseen, 0.0)
    return rows


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention of n sequences in float32 (one SDPA call, K/V not repeated).

    q [n, q_len, H, D], k/v [n, L, Hkv, D], seen [n, q_len, L] (True: the query sees the key;
    None: plain causal with q_len == L, which lets SDPA skip the masked half) ->
    [n, q_len, H, D] float32. Query head h reads K/V head h // (H // Hkv).
    """
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.float().transpose(1, 2),
        v.float().transpose(1, 2),
        attn_mask=None if seen is None else seen[:, None],
        is_causal=seen is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


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

    Decode rows (one new token each) go through in batched SDPA calls, each padded to its
    longest row (rows are grouped by length so padding never doubles a group's work); each
    longer query runs on its own, since its matmuls already fill the machine.
    """
    out = torch.empty_like(query)
    parts = _parts(block_tables, query_start_loc, seq_lens, k_cache.shape[1], sliding_window)
    for part in parts:
        q = query[part.tokens].view(part.n, part.q_len, *query.shape[1:])
        k = _gather(k_cache, part)
        v = _gather(v_cache, part)
        result = _attend(q, k, v, part.seen, scale).reshape(-1, *query.shape[1:])
        out[part.tokens] = result.to(out.dtype)
    return out


def combine_splits_ref(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = partial outputs [T, H, S, BLOCK_D] weighted by exp2 of their log-sum-exps
    [T, H, S] (base 2) over the sum of those; written into out [T, H, D]."""
    top = part_lse.amax(-1, keepdim=True)
    weight = torch.exp2(part_lse - top.clamp_min(-1e30))
    total = weight.sum(-1, keepdim=True).clamp_min(1e-30)
    out.copy_((part_out[..., : out.shape[-1]] * (weight / total)[..., None]).sum(-2))


def fused_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Each token's chosen experts' SwiGLU outputs summed by their routing weights: x [T, H],
    gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I], weights and ids [T, k].

    Plainly, expert by expert: the (token, slot) pairs that chose it, its two matmuls in x's
    dtype as the model runs them, the weighted rows added to their tokens in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, token, rows.float() * weights[token, slot, None].float())
    return out.to(x.dtype)

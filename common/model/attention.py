"""What one forward pass tells every attention layer about the flat batch, what a layer's paged
cache holds (`KVCacheSpec`, asked of the model class), and the attention call itself: one custom
op, so a compiled model keeps it out of its graph. A latent cache (one plane, MLA) is written
and read through `store_latent` and `context_latents`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import ops


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Flat-batch layout for one forward over B sequences and T = sum(query lengths) tokens.

    slot_mapping:    [T] int64, cache slot of each new token (block_id * block_size + offset)
    block_tables:    [B, max_blocks] int32, each sequence's physical blocks in logical order
    query_start_loc: [B + 1] int32, cumulative query lengths; sequence b owns tokens
                     query_start_loc[b]:query_start_loc[b + 1]
    seq_lens:        [B] int32, context length of each sequence including its new tokens

    The tensors are not changed once made: on the CPU the step's attention plan (groups,
    gather indices, masks) is made by the first layer and cached on seq_lens, which every
    layer, and the compiled decode's opaque op, gets as the same object
    (kernels/cpu.step_plan; a change in place is caught only outside inference mode).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The four tensors, in the order the attention op takes them."""
        return self.slot_mapping, self.block_tables, self.query_start_loc, self.seq_lens


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one layer's paged cache holds per token, as a model class asks for it: `planes`
    tensors (2: K at [0] and V at [1]; 1: one latent) of `heads` x `dim` values each. The
    runner allocates `shape(...)` per layer; the KV layout and its digest follow from it."""

    planes: int
    heads: int
    dim: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (self.planes, num_blocks, block_size, self.heads, self.dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of one layer."""
        return self.planes * block_size * self.heads * self.dim * dtype.itemsize


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's latent row [T, D] into its slot of a one-plane layer cache
    [1, num_blocks, block_size, 1, D]; rows past slot_mapping and negative slots are not
    stored (as for K/V)."""
    slots = slot_mapping.long()
    rows = latent[: slots.shape[0]]
    if not bool((slots >= 0).all()):
        valid = slots >= 0
        slots, rows = slots[valid], rows[valid]
    flat = cache[0].view(-1, cache.shape[-1])
    flat.index_copy_(0, slots, rows.to(cache.dtype))


def context_latents(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached latents [seq_len, D], in position order, from its block table."""
    block_size = cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return cache[0, blocks].reshape(-1, cache.shape[-1])[:seq_len]


def _store_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    rows = slot_mapping.shape[0]  # rows past it pad a compiled batch: not stored, output 0
    ops.store_kv(key[:rows], value[:rows], kv_cache[0], kv_cache[1], slot_mapping)
    out = ops.paged_attention(
        query[:rows],
        kv_cache[0],
        kv_cache[1],
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
    )
    if rows == query.shape[0]:
        return out.contiguous()  # the layout the fake promises, whatever the query's strides
    return torch.cat((out, out.new_zeros(query.shape[0] - rows, *out.shape[1:])))


# A custom op for torch.compile: the graph holds it as one opaque call, so it never sees block
# tables or sequence lengths (which change every step) and the kernels underneath (Triton on
# CUDA, torch references elsewhere, with their host-side planning) run as in eager mode.
# Defined through torch.library.Library rather than the custom_op decorator: the compiled
# graph calls it 30 times a step, and its dispatch costs ~7 us here against ~32 us.
_LIB = torch.library.Library("pdserve", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
    "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
    "float scale, int? sliding_window) -> Tensor"
)
_LIB.impl("paged_attention", _store_and_attend, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _paged_attention_fake(query: torch.Tensor, *_: object) -> torch.Tensor:
    """The output's shape and layout (a new contiguous [T, H, D]), for the compiler."""
    return query.new_empty(query.shape)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write this step's K/V rows [T, Hkv, D] into a layer's cache [2, blocks, block_size, Hkv,
    D], then attend: query [T, H, D] -> [T, H, D] (see kernels.ops.paged_attention).

    Rows past attn.slot_mapping's length are padding (a compiled decode step's batch rounded up
    to its bucket): they touch no cache and come out as zeros."""
    args = (query, key, value, kv_cache, *attn.tensors(), scale, sliding_window)
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.paged_attention.default(*args)
    return _store_and_attend(*args)  # eager: the op's body without its dispatch (~0.3 ms)

"""Whole-block copies between a paged layer cache and a contiguous page buffer.

Gather (cache -> pages) packs a request's blocks for a KV transfer; scatter (pages -> cache)
unpacks them on the receiving node. Both are one kernel: copy block `ids[i]` of one side to
block `i` of the other. A layer cache is [planes, N, bs, H, D]: planes 2 for K and V, 1 for
an MLA latent; the kernel copies every plane. References: `cpu.gather_pages`,
`cpu.scatter_pages`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype
from pdserve.kernels.cpu import check_pages_out

# Elements copied per program; large enough to amortise the block-id load, small enough
# that a 16 KiB-element block still spreads over several programs.
_TILE = 4096


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    stride_src_plane,
    stride_src_block,
    stride_dst_plane,
    stride_dst_block,
    block_elems,
    IDS_INDEX_SRC: tl.constexpr,
    TILE: tl.constexpr,
):
    # Grid: (page i, plane, tile of the block). A block's rows are compact (checked by the
    # launchers), so a block is one flat run of block_elems elements on both sides.
    page = tl.program_id(0)
    plane = tl.program_id(1)
    block_id = tl.load(block_ids_ptr + page).to(tl.int64)
    if IDS_INDEX_SRC:
        src_block = block_id
        dst_block = page.to(tl.int64)
    else:
        src_block = page.to(tl.int64)
        dst_block = block_id
    elems = tl.program_id(2) * TILE + tl.arange(0, TILE)
    mask = elems < block_elems
    # int64 block offsets: num_blocks * block_elems overflows int32 on real caches.
    src = src_ptr + plane * stride_src_plane + src_block * stride_src_block + elems
    dst = dst_ptr + plane * stride_dst_plane + dst_block * stride_dst_block + elems
    x = tl.load(src, mask=mask)
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _check_paged(name: str, t: torch.Tensor) -> None:
    if t.dim() != 5 or t.shape[0] not in (1, 2):
        raise ValueError(
            f"{name} must be [planes (1 or 2), n, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(t.shape)}"
        )
    check_dtype(name, t, FLOAT_DTYPES)
    _, _, block_size, heads, head_dim = t.shape
    if t.stride()[2:] != (heads * head_dim, head_dim, 1):
        raise ValueError(f"{name} blocks must be compact [block_size, H, D]; strides {t.stride()}")


def _check_ids(block_ids: torch.Tensor, layer_cache: torch.Tensor) -> None:
    if block_ids.dim() != 1 or block_ids.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"block_ids must be a 1-D tensor of {INDEX_DTYPES}; "
            f"got {tuple(block_ids.shape)} {block_ids.dtype}"
        )
    if block_ids.device != layer_cache.device:
        raise ValueError(f"block_ids on {block_ids.device}, layer_cache on {layer_cache.device}")


def _copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, ids_index_src: bool
):
    num_pages = block_ids.shape[0]
    if num_pages == 0:
        return
    block_elems = src[0, 0].numel()
    grid = (num_pages, src.shape[0], triton.cdiv(block_elems, _TILE))
    _copy_blocks_kernel[grid](
        src,
        dst,
        block_ids,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        block_elems,
        IDS_INDEX_SRC=ids_index_src,
        TILE=min(_TILE, triton.next_power_of_2(block_elems)),
    )


def gather_pages_triton(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy blocks `block_ids` of a layer cache [P, N, bs, H, D] into pages [P, n, bs, H, D]:
    new ones, or `out` (exactly that shape and dtype, contiguous, on the cache's device).

    Block ids must be in range: checking would need a device-to-host sync.
    """
    _check_paged("layer_cache", layer_cache)
    _check_ids(block_ids, layer_cache)
    if out is None:
        shape = (layer_cache.shape[0], block_ids.shape[0], *layer_cache.shape[2:])
        out = torch.empty(shape, dtype=layer_cache.dtype, device=layer_cache.device)
    check_pages_out(out, layer_cache, block_ids)
    _copy_blocks(layer_cache, out, block_ids, ids_index_src=True)
    return out


def scatter_pages_triton(
    layer_cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor
) -> None:
    """Write pages [P, n, bs, H, D] into blocks `block_ids` of a layer cache [P, N, bs, H, D],
    cast to its dtype.

    Block ids must be in range and distinct (as for `index_copy_`); not checked, to stay sync-free.
    """
    _check_paged("layer_cache", layer_cache)
    _check_paged("pages", pages)
    _check_ids(block_ids, layer_cache)
    if pages.shape != (layer_cache.shape[0], block_ids.shape[0], *layer_cache.shape[2:]):
        raise ValueError(
            f"pages {tuple(pages.shape)} do not match {block_ids.shape[0]} blocks "
            f"of layer_cache {tuple(layer_cache.shape)}"
        )
    if pages.device != layer_cache.device:
        raise ValueError(f"pages on {pages.device}, layer_cache on {layer_cache.device}")
    _copy_blocks(pages, layer_cache, block_ids, ids_index_src=False)

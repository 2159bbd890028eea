"""MLA's absorbed decode over the paged latent cache read in place (one paged attention call
for every sequence of a decode step) against the per-sequence `absorbed` it replaced."""

from __future__ import annotations

import torch

from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.deepseek import MlaAttention
from tests.common.model.test_mla import LATENT, ROPE_DIM, hf_config, randomize


def test_absorbed_paged_equals_absorbed_per_sequence():
    arch = ModelArchConfig.from_hf(hf_config())
    layer = MlaAttention(arch, 0)
    randomize(layer, 4)
    gen = torch.Generator().manual_seed(0)
    lens, block_size = [13, 30, 5], 4
    # Every latent row no sequence owns is NaN: a read past a sequence poisons its output.
    cache = torch.full((1, 20, block_size, 1, LATENT), float("nan"))
    blocks = torch.randperm(20, generator=gen).tolist()
    width = -(-max(lens) // block_size)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    latents = []
    for b, n in enumerate(lens):
        rows = torch.randn(n, LATENT, generator=gen)
        latents.append(rows)
        for j in range(-(-n // block_size)):
            tables[b, j] = block = blocks.pop()
            part = rows[j * block_size : (j + 1) * block_size]
            cache[0, block, : part.shape[0], 0] = part
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        block_tables=tables,
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(lens),
    )
    q_nope = torch.randn(len(lens), 4, 16, generator=gen)
    q_pe = torch.randn(len(lens), 4, ROPE_DIM, generator=gen)
    with torch.no_grad():
        paged = layer.absorbed_paged(q_nope, q_pe, cache, attn)
        each = [layer.absorbed(q_nope[b : b + 1], q_pe[b : b + 1], latents[b]) for b in range(3)]
    torch.testing.assert_close(paged, torch.cat(each), atol=1e-5, rtol=1e-5)

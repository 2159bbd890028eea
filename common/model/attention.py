"""What one forward pass tells every attention layer about the flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Flat-batch layout for one forward over B sequences and T = sum(query lengths) tokens.

    slot_mapping:    [T] int64, cache slot of each new token (block_id * block_size + offset)
    block_tables:    [B, max_blocks] int32, each sequence's physical blocks in logical order
    query_start_loc: [B + 1] int32, cumulative query lengths; sequence b owns tokens
                     query_start_loc[b]:query_start_loc[b + 1]
    seq_lens:        [B] int32, context length of each sequence including its new tokens
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int

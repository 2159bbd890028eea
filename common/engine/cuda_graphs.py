"""CUDA graphs of the compiled decode step (`compiled_decode.CompiledDecode` captures them after
compiling on CUDA), and the marking that keeps one graph per bucket whatever the batch's
composition. Nothing here runs on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.common.model.attention import AttentionMetadata


class DecodeGraphs:
    """One CUDA graph per bucket of the compiled decode step, over one set of static inputs.

    The graphs share a memory pool (captured largest first, as each reuses the pool) and the
    static buffers: a step copies its B rows in, pads the rest of its bucket (token 0, slot -1:
    no store, a sequence with no query token and length 0: no attention) and replays. Block
    tables are `max_blocks` wide, enough for max_model_len, so any context fits one graph; the
    attention kernels size their work from the lengths on the device, never from that width.
    The logits returned are a view of the graph's output, valid until the next replay.
    """

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        buckets: tuple[int, ...],
        max_blocks: int,
        kv_caches: list[torch.Tensor],
    ) -> None:
        device, rows = kv_caches[0].device, buckets[-1]
        i64, i32 = (
            {"dtype": torch.int64, "device": device},
            {"dtype": torch.int32, "device": device},
        )
        self.input_ids = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.slot_mapping = torch.full((rows,), -1, **i64)
        self.block_tables = torch.zeros(rows, max_blocks, **i32)
        self.query_start_loc = torch.zeros(rows + 1, **i32)
        self.seq_lens = torch.zeros(rows, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(buckets, reverse=True):
            meta = self._metadata(size)
            mark_unbacked(meta)  # the graph the warm-up compiled, not a new one
            args = (self.input_ids[:size], self.positions[:size], meta, kv_caches)
            step(*args)  # all rows padding: stores and attends nothing
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = step(*args)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1],
        )

    def fits(self, attn: AttentionMetadata) -> bool:
        """Whether this step's block tables fit the static ones (they do up to max_model_len)."""
        return attn.block_tables.shape[1] <= self.block_tables.shape[1]

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        size: int,
    ) -> torch.Tensor:
        """Logits [B, vocab] of B = len(input_ids) sequences through the graph of `size` rows."""
        batch, width = input_ids.shape[0], attn.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(attn.slot_mapping)
        self.block_tables[:batch, :width].copy_(attn.block_tables)
        self.query_start_loc[: batch + 1].copy_(attn.query_start_loc)
        self.seq_lens[:batch].copy_(attn.seq_lens)
        if size > batch:
            self.input_ids[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.slot_mapping[batch:size].fill_(-1)
            self.query_start_loc[batch + 1 : size + 1].fill_(batch)
            self.seq_lens[batch:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:batch]


def mark_unbacked(attn: AttentionMetadata) -> None:
    """Mark every size of the metadata unknown to the compiler: the graph only hands these
    tensors to the attention op, so any batch composition runs the bucket's one graph."""
    for t in attn.tensors():
        for dim in range(t.dim()):
            torch._dynamo.decorators.mark_unbacked(t, dim)

"""`draft_model`: a smaller model with the target's vocabulary drafts k tokens greedily, one
forward each, from KV of its own. That KV is a page group of the target's blocks: the runner
allocates the draft's layer caches with the same geometry and block count as the target's, so
one block id covers target and draft pages, the pool frees both at once, and a prefill node
ships the draft pages as layers after the target's (the KV layout counts them and names the
draft). Every forward of the target runs the draft over the same tokens and slots, so the
draft's pages hold the draft's KV of every computed token; proposing only adds the drafted
positions. Unlike the other drafters this one holds torch tensors (it is built by the model
runner, not by `create_proposer`).

Under tensor parallelism every rank holds its shard of the draft (the KV heads it holds of the
target's) and computes its pages with each step, so a prefill node at TP N ships the draft's
pages from every rank as it ships the target's. Proposing runs k forwards on rank 0 alone,
which the other ranks do not follow: a node that decodes is refused draft_model at TP > 1 at
start (`SpeculativeConfig.check_decoding_tp`); a prefill node at TP > 1 computes the draft's
pages and never drafts (the decode node of P TP 2 -> D TP 1 drafts from the pages both P ranks
shipped)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.common.model.attention import AttentionMetadata, KVCacheSpec
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.parallel import TPGroup
from pdserve.common.model.registry import model_class
from pdserve.common.model.weights import load_model, model_fingerprint
from pdserve.common.spec.base import Proposer
from pdserve.common.spec.config import SpeculativeConfig


def scratch_blocks(block_size: int, max_k: int) -> int:
    """Blocks a proposal may write past the request's own: k drafted positions from any
    offset of the block holding the last known token span at most this many blocks."""
    return (block_size + max_k - 2) // block_size + 1


def draft_table(
    block_ids: Sequence[int], scratch: Sequence[int], first: int, k: int, block_size: int
) -> list[int]:
    """The block table a proposal of k positions from `first` (the last known token) runs
    over: the request's blocks up to `first`'s, then scratch blocks for what lies past them."""
    owned = list(block_ids[: -(-first // block_size)])
    table = owned + list(scratch[: (first + k - 1) // block_size + 1 - len(owned)])
    assert (first + k - 1) // block_size < len(table), "drafts past the scratch blocks"
    return table


def one_position(
    table: list[int], pos: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """A one-sequence, one-token step at `pos` over `table` (a proposal's draft forward)."""
    return AttentionMetadata(
        slot_mapping=torch.tensor(
            [table[pos // block_size] * block_size + pos % block_size], device=device
        ),
        block_tables=torch.tensor([table], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([pos + 1], dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=pos + 1,
    )


def check_draft(draft: ModelArchConfig, target: ModelArchConfig, same_pages: bool) -> None:
    """ValueError unless the draft can serve the target: the same vocabulary, at least the
    target's positions, and pages of the target's geometry (they travel as its layers)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} tokens, "
            f"the target's {target.vocab_size}"
        )
    if draft.max_position_embeddings < target.max_position_embeddings:
        raise ValueError(
            f"speculative_config.model: the draft holds {draft.max_position_embeddings} "
            f"positions, fewer than the target's {target.max_position_embeddings}"
        )
    if not same_pages:
        raise ValueError(
            "speculative_config.model: the draft's KV pages (planes, KV heads, head_dim) must "
            "equal the target's: its pages share the target's blocks and transfers"
        )


def layer_caches(
    shape: tuple[int, ...],
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device,
    draft: PageGroup | None,
) -> list[torch.Tensor]:
    """A runner's layer caches of `shape` ([planes, num_blocks, ...]): one per target layer,
    then a draft's. With a draft every cache gets its scratch blocks past the pool's, the same
    in each, so that all the caches keep one shape for the KV connectors."""
    if draft is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    planes, num_blocks, block_size, *page = shape
    extra = scratch_blocks(block_size, draft.max_k)
    full = (planes, num_blocks + extra, block_size, *page)
    caches = [
        torch.zeros(full, dtype=dtype, device=device) for _ in range(num_layers + draft.num_layers)
    ]
    scratch = list(range(num_blocks, num_blocks + extra))
    draft.attach(caches[num_layers:], scratch, block_size, num_layers)
    return caches


class PageGroup:
    """A drafter's layer caches in the target's blocks (draft_model's, mtp's): the runner
    sizes the pool, then `attach`es them after the target's `first_layer` caches.

    `scratch` are block ids past the pool's (the caches have them, the pool never hands them
    out): a proposal writes the drafted positions that lie past the request's own blocks
    there, so drafting takes no block from the pool."""

    num_layers: int  # layer caches of the group (a property of each drafter)

    def __init__(self, device: torch.device, max_k: int, layout_tag: str) -> None:
        self.device = device
        self.max_k = max_k
        self.layout_tag = layout_tag  # what a KV layout's model id says of the group
        self.caches: list[torch.Tensor] = []
        self.scratch: list[int] = []
        self.block_size = 0
        self.first_layer = 0  # the index a prefill node ships the group's layer 0 as
        self.proposes = True  # False: it computes its pages but drafts nothing

    def attach(
        self, caches: list[torch.Tensor], scratch: list[int], block_size: int, first_layer: int
    ) -> None:
        """The group's layer caches, once the runner has sized the pool."""
        assert len(caches) == self.num_layers, f"{len(caches)} caches, {self.num_layers} layers"
        self.caches, self.scratch, self.block_size = caches, scratch, block_size
        self.first_layer = first_layer

    def propose(self, tokens: Sequence[int], block_ids: Sequence[int], k: int) -> list[int]:
        """k greedy drafts after `tokens`, whose KV but the last token's is in the group's
        pages of `block_ids` (each drafter its own way: `DraftModel`, mtp's `MtpDraft`)."""
        raise NotImplementedError

    def _longs(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class DraftModel(PageGroup):
    """The draft model and its layer caches (a page group of the target's blocks)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        assert config.model is not None, "a draft_model config names its model"
        shard = tp.shard if tp is not None else None
        self.model, self.arch = load_model(config.model, dtype, device, tp=tp)
        target_spec = model_class(target).kv_cache_spec(target, shard)  # the target's family
        self.spec: KVCacheSpec = type(self.model).kv_cache_spec(self.arch, shard)
        check_draft(self.arch, target, self.spec == target_spec)
        if device.type == "cpu":
            self.model.use_cpu_head()
        self.model_id = model_fingerprint(config.model)
        super().__init__(device, config.num_speculative_tokens, f"draft:{self.model_id}")
        self.proposes = tp is None  # a prefill node's ranks: see the module's docstring

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """The draft's forward over a step of the target: writes its pages at the step's
        slots (its logits are not needed: drafting starts from the last known token; the
        target's `hidden` states are not either). The step's layer hook (a prefill node's
        KV sends) gets draft layer i as first_layer + i."""
        shifted = None
        if on_layer is not None:
            shifted = lambda i: on_layer(self.first_layer + i)  # noqa: E731
        self.model(input_ids, positions, attn, self.caches, shifted)

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], block_ids: Sequence[int], k: int) -> list[int]:
        """k greedy drafts after `tokens`, whose KV but the last token's is in the draft's
        pages of `block_ids`. The drafted positions' pages are written in the request's last
        block and in scratch blocks; the verify step's draft forward rewrites them."""
        first = len(tokens) - 1
        table = draft_table(block_ids, self.scratch, first, k, self.block_size)
        out: list[int] = []
        token = tokens[-1]
        for pos in range(first, first + k):
            attn = one_position(table, pos, self.block_size, self.device)
            hidden = self.model(self._longs([token]), self._longs([pos]), attn, self.caches)
            token = int(self.model.compute_logits(hidden[-1:]).argmax(dim=-1)[0])
            out.append(token)
        return out


class DraftModelProposer(Proposer):
    """The `Proposer` face of a `DraftModel`: a request's KV lives in its blocks, looked up by
    id (`block_ids`, the KV cache manager's), so the proposer keeps no state of its own."""

    def __init__(self, draft: PageGroup, block_ids: Callable[[str], Sequence[int]]) -> None:
        self.draft = draft
        self._block_ids = block_ids

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not tokens or not self.draft.proposes:
            return []
        return self.draft.propose(tokens, self._block_ids(request_id), k)

    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        """Nothing to free: the draft's pages go back with the request's blocks."""

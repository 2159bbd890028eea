"""`mtp`: DeepSeek-V3's multi-token-prediction layer drafts k tokens, one run of the layer per
token, from the target's last hidden state (common/model/deepseek_mtp.py).

Its state is a page group of the target's blocks, as draft_model's (`layer_caches` allocates
it): first the target's hidden state of every computed position, cut into pieces of one page
row each ("hidden layers": ceil(hidden / page row) of them, a page row being the values one
token takes in one layer's cache), then the MTP layer's own latent cache. Both live at the
position's slot, so they go back to the pool with the request's blocks, survive prefix caching
and preemption like the target's KV, and a prefill node ships them as layers after the
target's, on the same transfer: the decode node drafts from them and recomputes nothing.

The MTP entry at position j joins the target's hidden state at j - 1 (zeros at j = 0) with
the embedding of token j, so a step of the target writes the entries of the same positions and
slots it computes (vLLM keeps the pair at j - 1; rope sees only relative positions, so the
attention is the same, but for the extra entry at position 0). Every forward of the target
writes its hidden pages, then runs the MTP layer over the step's tokens; a proposal after
token j (the last known, not yet computed) starts from the hidden page of j - 1 and writes only
the drafted positions (in the request's last block and in scratch blocks past the pool's),
which the next step rewrites."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.common.model.attention import AttentionMetadata, KVCacheSpec
from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.deepseek_mtp import load_mtp
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.draft_model import PageGroup, draft_table, one_position


def hidden_layers(hidden_size: int, spec: KVCacheSpec) -> int:
    """Layer caches of `spec`'s geometry that one token's hidden state fills."""
    row = spec.planes * spec.heads * spec.dim
    return -(-hidden_size // row)


class MtpDraft(PageGroup):
    """The MTP layer, the target's embedding and rope it shares, and its page group: the
    hidden layers, then the MTP layer's cache. Proposes like `DraftModel`."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target_dir: str,
        target: ModelArchConfig,
        spec: KVCacheSpec,
        dtype: torch.dtype,
        device: torch.device,
        dummy_seed: int | None = None,
    ) -> None:
        self.layer = load_mtp(target_dir, target, dtype, device, dummy_seed)
        self.hidden_size = target.hidden_size
        self.num_hidden = hidden_layers(target.hidden_size, spec)
        super().__init__(device, config.num_speculative_tokens, "mtp")
        self.embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rope: Callable[..., tuple[torch.Tensor, ...]] | None = None

    @property
    def num_layers(self) -> int:
        """Layer caches of the page group: the hidden layers and the MTP layer's."""
        return self.num_hidden + 1

    def bind(self, target: torch.nn.Module) -> None:
        """The target's embedding and rope, once the runner has loaded it."""
        self.embed, self.rope = target.model.embed_tokens, target.model.rotary_emb

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """After a step of the target: its hidden states [T, hidden] into the hidden pages,
        then the MTP layer over the step's tokens, each with the hidden state of the position
        before it. The step's layer hook gets page-group layer i as first_layer + i."""
        assert hidden is not None, "mtp needs the target's hidden states (an eager step)"
        slots = attn.slot_mapping.long()
        self._store_hidden(hidden[: slots.shape[0]], slots)
        for i in range(self.num_hidden):
            if on_layer is not None:
                on_layer(self.first_layer + i)
        previous = self._previous_hidden(positions, attn)
        self._forward(input_ids, positions, previous, attn)
        if on_layer is not None:
            on_layer(self.first_layer + self.num_hidden)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.embed is not None and self.rope is not None, "bind the target first"
        embeds = self.embed(input_ids)
        cos, sin = self.rope(positions, embeds.dtype)
        return self.layer(embeds, previous.to(embeds.dtype), cos, sin, attn, self.caches[-1])

    def _rows(self, cache: torch.Tensor) -> torch.Tensor:
        """A hidden layer's cache as [planes, slots, row] (a view)."""
        return cache.view(cache.shape[0], -1, cache[0, 0, 0].numel())

    def _store_hidden(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        valid = slots >= 0
        hidden, slots = hidden[valid], slots[valid]
        pieces = self._split(hidden)
        for cache, piece in zip(self.caches[: self.num_hidden], pieces, strict=True):
            rows = self._rows(cache)
            piece = piece.to(cache.dtype).view(len(slots), rows.shape[0], -1)
            rows[:, slots] = piece.transpose(0, 1)

    def _split(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """[T, hidden] as num_hidden pieces [T, planes * row], zero-padded at the end."""
        width = self._rows(self.caches[0]).shape[0] * self._rows(self.caches[0]).shape[2]
        padded = torch.nn.functional.pad(hidden, (0, width * self.num_hidden - hidden.shape[1]))
        return list(padded.split(width, dim=1))

    def read_hidden(self, slots: torch.Tensor) -> torch.Tensor:
        """The hidden states [N, hidden] stored at `slots`."""
        pieces = []
        for cache in self.caches[: self.num_hidden]:
            rows = self._rows(cache)[:, slots]  # [planes, N, row]
            pieces.append(rows.transpose(0, 1).reshape(len(slots), -1))
        return torch.cat(pieces, dim=1)[:, : self.hidden_size]

    def _previous_hidden(self, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """For each token of the step, the target's hidden state at the position before it
        (read from the hidden pages: this step's, or a former step's, a cached prefix's or a
        prefill node's); zeros before position 0."""
        starts = attn.query_start_loc.long()
        counts = starts[1:] - starts[:-1]
        seq = torch.repeat_interleave(torch.arange(len(counts), device=self.device), counts)
        before = (positions[: len(seq)].long() - 1).clamp(min=0)
        blocks = attn.block_tables.long()[seq, before // self.block_size]
        previous = self.read_hidden(blocks * self.block_size + before % self.block_size)
        return previous.masked_fill((positions[: len(seq)] == 0)[:, None], 0.0)

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], block_ids: Sequence[int], k: int) -> list[int]:
        """k greedy drafts after `tokens`, whose entries but the last token's are in the page
        group of `block_ids`: the MTP layer runs k times, each from the hidden state the run
        before gave (the first from the target's at the last computed position)."""
        bs, first = self.block_size, len(tokens) - 1
        assert first >= 1, "a proposal follows a step of the target"
        table = draft_table(block_ids, self.scratch, first, k, bs)
        last = first - 1
        previous = self.read_hidden(self._longs([table[last // bs] * bs + last % bs]))
        out: list[int] = []
        token = tokens[-1]
        for pos in range(first, first + k):
            attn = one_position(table, pos, bs, self.device)
            previous = self._forward(self._longs([token]), self._longs([pos]), previous, attn)
            token = int(self.layer.compute_logits(previous).argmax(dim=-1)[0])
            out.append(token)
        return out

"""Qwen3-MoE and Mixtral: the Llama-family decoder stack with a sparse mixture-of-experts block
in place of (some of) its MLPs.

Attention, norms, rope and the stack are llama.py's; only the feed-forward block differs. The
experts live stacked, [E, out, in] per projection, under transformers 5's in-memory names, so
the batched path is a handful of index and matmul ops; `stack_experts` turns the per-expert
tensors that checkpoints hold into those stacks while the loader reads them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.model.config import ModelArchConfig
from pdserve.common.model.families import QWEN3_MOE
from pdserve.common.model.llama import MLP, DecoderLayer, LlamaFamilyForCausalLM, _reduced
from pdserve.common.model.parallel import TPGroup, TPShard
from pdserve.kernels import ops


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): the top-k of the router's softmax, taken in
    float32 as transformers does, rescaled to sum to 1 when `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    groups: tuple[int, int],
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing, (weights [T, k] float32, expert ids [T, k]).

    Sigmoid scores in float32; `bias` (e_score_correction_bias) is added for choosing only.
    With `groups` = (n_group, topk_group) the experts form n_group equal groups, each scored
    by the sum of its two best biased scores, and a token picks its top_k experts inside its
    topk_group best groups. The weights are the chosen experts' unbiased scores, renormalized
    to sum to 1 when `renormalize`, times `scale` (routed_scaling_factor)."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    n_group, topk_group = groups
    per_group = choice.view(choice.shape[0], n_group, -1)
    best_two = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    chosen = best_two.topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, chosen, True)
    choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1), -torch.inf)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert over rows x [N, H]: down(silu(gate(x)) * up(x))."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def experts_grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The weighted sum of each token's chosen experts, tokens grouped by expert.

    The T*k (token, expert) pairs are sorted by expert so each expert's tokens are one
    contiguous run: one matmul pair per expert that has any, then one index_add puts every
    weighted row back on its token. The loop is over experts, never over tokens. An id equal
    to the number of experts given (`Experts.local_ids`: another rank's expert) adds nothing.
    """
    k, held = ids.shape[1], gate_up.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=held + 1).tolist()[:held]
    mine = sum(counts)
    if mine == 0:
        return torch.zeros_like(x)
    order = order[:mine]  # the other ranks' pairs sort last
    token = order // k
    runs = torch.split(x[token], counts)
    out_rows = torch.cat(
        [_swiglu(run, gate_up[e], down[e]) for e, run in enumerate(runs) if len(run)]
    )
    scaled = out_rows * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, token, scaled.to(x.dtype))


def experts_gathered(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The same sum with static shapes and no host sync: each (token, expert) pair gathers its
    expert's matrices and the pairs run as one batched matmul. A compiled decode step (and its
    CUDA graph) can hold this; it copies T*k experts' weights, so it is for decode-sized
    batches until a fused kernel replaces both paths. Another rank's expert (an id equal to
    the number given) gets weight 0."""
    t, k = ids.shape
    held = gate_up.shape[0]
    weights = weights.masked_fill(ids >= held, 0.0)
    flat = ids.clamp(max=held - 1).flatten()
    rows = x.repeat_interleave(k, dim=0)[:, :, None]
    gate, up = torch.bmm(gate_up[flat], rows).squeeze(-1).chunk(2, dim=-1)
    out_rows = torch.bmm(down[flat], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
    scaled = out_rows * weights.reshape(t * k, 1)
    return scaled.view(t, k, x.shape[1]).sum(dim=1).to(x.dtype)


class Experts(nn.Module):
    """The experts' SwiGLU weights stacked: gate_up_proj [E, 2I, H] (each expert's gate rows,
    then its up rows) and down_proj [E, H, I], for the E experts of width I this rank holds
    (`TPShard.experts`, `expert_width`: all of them, or its share under expert parallelism).
    The output is this rank's partial sum; the block that owns the experts reduces it."""

    def __init__(self, config: ModelArchConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        shard = shard or TPShard()
        held, h, i = shard.experts(config), config.hidden_size, shard.expert_width(config)
        self.first, self.num_experts = held.start, config.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(len(held), 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(len(held), h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            run = experts_gathered
        elif x.is_cuda:
            run = ops.fused_moe  # the grouped GEMM kernel (kernels/fused_moe.py)
        else:
            run = experts_grouped
        return run(x, self.gate_up_proj, self.down_proj, weights, self.local_ids(ids))

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids as indices into this rank's stack; another rank's expert becomes
        the stack's length, which the expert functions skip."""
        held = self.gate_up_proj.shape[0]
        if held == self.num_experts:
            return ids
        local = ids - self.first
        return local.masked_fill((local < 0) | (local >= held), held)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a bias-free linear to one logit per expert), top-k of its softmax, and
    the chosen experts' outputs summed by their weights.

    Qwen3-MoE casts the weights to the activations' dtype before scaling; Mixtral scales in
    float32 and casts the product. Equal in float32, they differ in bfloat16, so each family
    keeps its own order.
    """

    def __init__(self, config: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.weights_in_input_dtype = config.architecture == QWEN3_MOE
        self.tp = tp
        # The router is whole on every rank: each routes every token, so all agree.
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config, tp.shard if tp is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        return _reduced(self.experts(x, weights, ids), self.tp)

    def fuse(self) -> None:
        """Nothing to join: the experts are stacked already (the runner fuses every block)."""


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is the experts where the config says so."""

    def feed_forward(self, config: ModelArchConfig, layer: int, tp: TPGroup | None) -> nn.Module:
        return SparseMoeBlock(config, tp) if config.is_moe_layer(layer) else MLP(config, tp)


class MoeForCausalLM(LlamaFamilyForCausalLM):
    """Qwen3-MoE (qk-norm attention, dense layers from mlp_only_layers and
    decoder_sparse_step) and Mixtral (sliding window as Mistral): the config decides which.
    Under tensor parallelism attention splits as the dense families'; the experts as
    `TPShard` says (a slice of each, or whole ones with expert parallelism)."""

    layer_class = MoeDecoderLayer


# Mixtral checkpoints name the block `block_sparse_moe` and its projections w1 (gate), w3 (up)
# and w2 (down); Qwen3-MoE's name them as the dense MLP does.
_MIXTRAL_BLOCK = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.")
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_ROLE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class _LayerExperts:
    """One layer's per-expert matrices read so far, by projection and expert."""

    parts: dict[str, dict[int, torch.Tensor]] = field(
        default_factory=lambda: {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
    )

    def add(self, role: str, expert: int, tensor: torch.Tensor) -> None:
        self.parts[role][expert] = tensor

    def take_stacks(self, prefix: str, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Each stack whose experts have all arrived, once (their parts are dropped)."""
        gate, up, down = (self.parts[r] for r in ("gate_proj", "up_proj", "down_proj"))
        every = range(num_experts)
        if _complete(gate, every) and _complete(up, every):
            rows = [torch.cat([gate[e], up[e]]) for e in every]
            gate.clear()
            up.clear()
            yield f"{prefix}.gate_up_proj", torch.stack(rows)
        if _complete(down, every):
            yield f"{prefix}.down_proj", torch.stack([down[e] for e in every])
            down.clear()

    def leftovers(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        for role, by_expert in self.parts.items():
            for expert, tensor in by_expert.items():
                yield f"{prefix}.{expert}.{role}.weight", tensor


def _complete(by_expert: dict[int, torch.Tensor], every: range) -> bool:
    return len(by_expert) == len(every) and all(e in by_expert for e in every)


def stack_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], config: ModelArchConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under our parameter names: Mixtral's block renamed to `mlp`,
    per-expert matrices (Hub checkpoints, and what transformers' save_pretrained writes)
    stacked into `experts.gate_up_proj` and `experts.down_proj` as soon as a layer's set is
    complete; stacked ones pass as they are. An incomplete set comes out under its own names,
    so the loader names it among the unexpected weights."""
    pending: dict[str, _LayerExperts] = {}
    for name, tensor in tensors:
        name = _MIXTRAL_BLOCK.sub(r"\1.mlp.", name)
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, role = match.group(1), int(match.group(2)), match.group(3)
        layer = pending.setdefault(prefix, _LayerExperts())
        layer.add(_ROLE.get(role, role), expert, tensor)
        yield from layer.take_stacks(prefix, config.num_experts)
    for prefix, layer in pending.items():
        yield from layer.leftovers(prefix)

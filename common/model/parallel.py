"""Tensor parallelism inside one node: which slice of every weight a rank holds, and the
collectives a rank's forward calls.

Query heads, KV heads and the MLP's intermediate columns split evenly across ranks (q/k/v and
gate/up by output rows, o and down by input columns, followed by an all-reduce); the embedding
and the LM head split by vocabulary rows. When there are more ranks than KV heads, each KV head
is held by `size // num_kv_heads` consecutive ranks: rank r's query heads all read KV head
`r // (size // num_kv_heads)`, so grouped-query attention needs no communication.

Mixture-of-experts layers split their experts' intermediate width the same way (every rank
holds a slice of every expert) or, with expert parallelism, whole experts (each rank
num_experts / size of them); either way each rank's expert sum is partial and one all-reduce
per layer combines it. Latent attention (MLA) splits its query heads; the latent is whole on
every rank.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

from pdserve.common.model.config import ModelArchConfig
from pdserve.common.wire.payloads import check_kv_split, rank_kv_heads

if TYPE_CHECKING:
    from pdserve.common.model.quant import QuantizedWeight

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True, slots=True)
class TPShard:
    """Which of `size` ranks this process is."""

    rank: int = 0
    size: int = 1
    # Experts held whole, num_experts / size per rank (vLLM's --enable-expert-parallel),
    # instead of a 1/size slice of every expert's width.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    def check(self, arch: ModelArchConfig) -> None:
        """ValueError naming both numbers when `arch` cannot split across `size` ranks."""
        n, heads = self.size, arch.num_heads
        if heads % n:
            raise ValueError(f"{heads} attention heads do not split across {n} ranks")
        check_kv_split(arch.num_kv_heads, n)  # (MLA: as many as query heads, unused)
        _check_width("MLP intermediate size", arch.intermediate_size, n)
        if arch.moe_layers:
            self._check_experts(arch)

    def _check_experts(self, arch: ModelArchConfig) -> None:
        n = self.size
        if self.expert_parallel and arch.num_experts % n:
            raise ValueError(
                f"{arch.num_experts} experts do not split across {n} ranks "
                "(expert parallelism gives each rank whole experts)"
            )
        if not self.expert_parallel:
            _check_width("expert intermediate size", arch.moe_intermediate_size, n)
        shared = arch.n_shared_experts * arch.moe_intermediate_size
        _check_width("shared experts' intermediate size", shared, n)

    def experts(self, arch: ModelArchConfig) -> range:
        """The global ids of the experts this rank holds: all of them (a slice of each one's
        width), or under expert parallelism its num_experts / size consecutive ones, whole."""
        if not self.expert_parallel:
            return range(arch.num_experts)
        per = arch.num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def expert_width(self, arch: ModelArchConfig) -> int:
        """The intermediate width of each expert this rank holds."""
        if self.expert_parallel:
            return arch.moe_intermediate_size
        return arch.moe_intermediate_size // self.size

    def num_heads(self, arch: ModelArchConfig) -> int:
        return arch.num_heads // self.size

    def num_kv_heads(self, arch: ModelArchConfig) -> int:
        """KV heads this rank holds: its share, or one replicated head."""
        return max(1, arch.num_kv_heads // self.size)

    def kv_heads(self, arch: ModelArchConfig) -> range:
        """The global indices of the KV heads this rank holds."""
        return rank_kv_heads(arch.num_kv_heads, self.size, self.rank)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, end row, rows per rank): rank r holds embedding and LM-head rows
        [first, end), padded with zero rows to `rows per rank` so every rank's shard has one
        shape (gathered logits are cut back to vocab_size)."""
        per = -(-vocab_size // self.size)
        first = min(self.rank * per, vocab_size)
        return first, min(first + per, vocab_size), per

    def shard(self, name: str, tensor: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
        """This rank's slice of the full checkpoint tensor `name` (a new tensor when sliced)."""
        if self.size == 1:
            return tensor
        if name.endswith(_STACKED_EXPERTS):
            return self._shard_experts(name, tensor, arch)
        kind = _kind(name)
        if kind in ("q", "gate_up"):
            return _even(tensor, 0, self.rank, self.size)
        if kind == "kv":
            heads = self.kv_heads(arch)
            d = arch.head_dim
            return tensor[heads.start * d : heads.stop * d].clone()
        if kind == "row" and name.endswith(".bias"):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)  # added once
        if kind == "row":
            return _even(tensor, 1, self.rank, self.size)
        if kind == "vocab":
            first, end, per = self.vocab_rows(arch.vocab_size)
            out = tensor.new_zeros(per, *tensor.shape[1:])
            out[: end - first] = tensor[first:end]
            return out
        return tensor  # norms: every rank holds them whole

    def _shard_experts(
        self, name: str, tensor: torch.Tensor, arch: ModelArchConfig
    ) -> torch.Tensor:
        """A stacked expert tensor: gate_up_proj [E, 2I, H] (each expert's gate rows, then its
        up rows) or down_proj [E, H, I], cut to this rank's experts or width."""
        if self.expert_parallel:
            held = self.experts(arch)
            return tensor[held.start : held.stop].clone()
        if name.endswith("down_proj"):
            return _even(tensor, 2, self.rank, self.size)
        gate, up = tensor.chunk(2, dim=1)  # slice each, so a rank's rows stay [gate; up]
        mine = [part.chunk(self.size, 1)[self.rank] for part in (gate, up)]
        return torch.cat(mine, dim=1)

    def shard_quantized(
        self, name: str, weight: QuantizedWeight, arch: ModelArchConfig
    ) -> QuantizedWeight:
        """This rank's slice of a decoder linear weight kept quantized, as `shard` slices a
        float one (the bias of a row-parallel layer is a float tensor, sliced by `shard`)."""
        kind = _kind(name)
        if self.size == 1 or kind == "whole":
            return weight
        if kind in ("q", "gate_up"):
            return weight.shard(0, self.rank, self.size)
        if kind == "kv":
            heads, d = self.kv_heads(arch), arch.head_dim
            return weight.narrow(0, heads.start * d, len(heads) * d)
        if kind == "row":
            return weight.shard(1, self.rank, self.size)
        raise ValueError(f"{name}: a {kind} weight is not held quantized")


_STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _check_width(what: str, width: int, n: int) -> None:
    if width % n:
        raise ValueError(f"{what} {width} does not split across {n} ranks")


def _kind(name: str) -> str:
    """How a parameter splits, from its HF name."""
    module = name.rsplit(".", 2)[-2]
    # MLA's q_b_proj and kv_b_proj rows are per query head, as q_proj's.
    if module in ("q_proj", "q_b_proj", "kv_b_proj"):
        return "q"
    if module in ("k_proj", "v_proj"):
        return "kv"
    if module in ("gate_proj", "up_proj"):
        return "gate_up"
    if module in ("o_proj", "down_proj"):
        return "row"
    if module in ("embed_tokens", "lm_head"):
        return "vocab"
    return "whole"


def _even(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return tensor.chunk(size, dim)[rank].clone()


class TPGroup:
    """The ranks of one node, joined by a torch.distributed process group (gloo on CPU, NCCL
    on CUDA) built with a timeout: every collective here fails after it instead of waiting.

    The model's collectives are torch's functional ones, addressed by the group's registered
    name, so a compiled decode step traces them into its graph like any other op. `lock`
    serialises collectives issued from more than one thread of a rank (the driver's step and
    its keep-alive): the ranks must see one sequence of collectives."""

    def __init__(self, shard: TPShard, process_group: Any, name: str) -> None:
        self.shard = shard
        self.process_group = process_group
        self.name = name
        self.lock = threading.RLock()

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def rank(self) -> int:
        return self.shard.rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor` (a new tensor)."""
        return _c10d.wait_tensor(_c10d.all_reduce(tensor, "sum", self.name))

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` [N, C] joined along its last dimension [N, size * C], on every
        rank."""
        n = self.size
        stacked = _c10d.wait_tensor(_c10d.all_gather_into_tensor(tensor.contiguous(), n, self.name))
        rows, cols = tensor.shape
        return stacked.view(n, rows, cols).permute(1, 0, 2).reshape(rows, n * cols)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` stacked [size, *tensor.shape], on every rank."""
        n = self.size
        flat = _c10d.wait_tensor(_c10d.all_gather_into_tensor(tensor.contiguous(), n, self.name))
        return flat.view(n, *tensor.shape)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank (a new tensor)."""
        return _c10d.wait_tensor(_c10d.broadcast(tensor, 0, self.name))

    def all_reduce_min(self, tensor: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """The smallest of every rank's `tensor`, in place, waiting at most `timeout_s` (for
        the start-up agreement, when ranks may be far apart)."""
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp.MIN
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        self.process_group.allreduce([tensor], opts).wait()
        return tensor

    def close(self) -> None:
        """Forget the group's name (its connections close with the process group)."""
        _unregister_process_group(self.name)


def join_group(
    shard: TPShard,
    store: torch.distributed.Store,
    timeout_s: float,
    device: str,
    name: str,
    gloo_host: str | None = None,
) -> TPGroup:
    """This rank's member of the group that meets at `store` (gloo on CPU, NCCL on CUDA),
    registered as `name` (unique in this process) for the functional collectives.

    gloo_host: the address this rank's gloo connections bind and are reached at (127.0.0.1
    for a group on one host); None lets gloo pick the address the host name resolves to."""
    dist = torch.distributed
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, shard.rank, shard.size, options)
        kind, backend_device = dist.ProcessGroup.BackendType.NCCL, torch.device(device)
    else:
        gloo = dist.ProcessGroupGloo._Options()
        gloo._timeout = timeout
        if gloo_host:
            gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_host)]
        else:
            gloo._devices = [dist.ProcessGroupGloo.create_default_device()]
        backend = dist.ProcessGroupGloo(store, shard.rank, shard.size, gloo)
        kind, backend_device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    group = dist.ProcessGroup(store, shard.rank, shard.size)
    group._register_backend(backend_device, kind, backend)
    group._set_default_backend(kind)
    group._set_group_name(name)
    _register_process_group(name, group)
    return TPGroup(shard, group, name)

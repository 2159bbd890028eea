"""The fused-MoE kernel against its torch reference: on CPU by the Triton interpreter (tiny
blocks, so non-multiple H and I exercise every mask), on a GPU (PDSERVE_TEST_DEVICE=cuda)
compiled for real, bf16 included. TRITON_INTERPRET must be set before the kernel is imported.
"""

from __future__ import annotations

import os

from tests.devices import ON_CUDA, TEST_DEVICE, require_device

if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the torch reference still runs")

from pdserve.common.model.moe import experts_gathered, experts_grouped  # noqa: E402
from pdserve.kernels import ops  # noqa: E402
from pdserve.kernels.fused_moe import align_pairs, fused_moe_triton  # noqa: E402
from pdserve.kernels.reference import fused_moe_ref  # noqa: E402
from tests.kernels.test_triton_kernels import BF16_DOT_BROKEN, TOLERANCE  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
HIDDEN, INTER = 40, 24  # neither a multiple of the test blocks below
TILES = {"block_m": 16, "block_n": 32, "block_k": 16}


@pytest.fixture(autouse=True)
def _device_present() -> None:
    require_device()


def make_layer(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] and down [E, H, I], scaled so every output is of magnitude ~1."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    return gate_up, down


def make_routing(
    tokens: int, top_k: int, choices: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], weights [T, k] and ids [T, k]: k distinct experts per token from `choices`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    picks = [torch.randperm(len(choices), generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.tensor(choices)[torch.stack(picks)] if tokens else torch.zeros(0, top_k).long()
    return x, torch.rand(tokens, top_k, generator=gen), ids


def run_both(x, gate_up, down, weights, ids, dtype=torch.float32) -> tuple[torch.Tensor, ...]:
    """(kernel output on the test device, back on CPU; reference output) in `dtype`."""
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    moved = [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]
    out = fused_moe_triton(*moved, **TILES).cpu()
    return out, fused_moe_ref(x, gate_up, down, weights, ids)


# The attention tests' tolerances hold here too: fp32 differs from the reference only by
# summation order; fp16/bf16 both round the gate_up output and the activation to the input
# dtype (one ulp flipped in one of I terms moves the output far less than its own rounding),
# then the output once: a few output ulps (fp16 2**-11, bf16 2**-8 relative) on outputs ~2.
def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_fused_moe_fp32(tokens, num_experts, top_k):
    gate_up, down = make_layer(num_experts, seed=num_experts)
    x, weights, ids = make_routing(tokens, top_k, list(range(num_experts)), seed=tokens + top_k)
    assert_matches(*run_both(x, gate_up, down, weights, ids))


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_DOT_BROKEN)]
)
def test_fused_moe_half(dtype):
    gate_up, down = make_layer(8, seed=1)
    x, weights, ids = make_routing(33, 2, list(range(8)), seed=2)
    assert_matches(*run_both(x, gate_up, down, weights, ids, dtype))


@pytest.mark.parametrize(
    "tokens, top_k, choices",
    [(9, 2, [1, 6]), (33, 1, [3]), (20, 2, [0, 7])],
    ids=["most-experts-empty", "all-to-one-expert", "all-to-the-same-two"],
)
def test_fused_moe_skewed_routing(tokens, top_k, choices):
    gate_up, down = make_layer(8, seed=3)
    x, weights, ids = make_routing(tokens, top_k, choices, seed=4)
    assert_matches(*run_both(x, gate_up, down, weights, ids))


def test_another_ranks_experts_add_nothing():
    """Expert parallelism: a rank holds 4 of 8 experts; pairs routed to the others come as id
    4 (the stack's length) and contribute zero, in the kernel, the reference and moe.py."""
    gate_up, down = make_layer(4, seed=13)
    x, weights, ids = make_routing(11, 2, list(range(8)), seed=14)
    local = ids.masked_fill(ids >= 4, 4)
    out, expected = run_both(x, gate_up, down, weights, local)
    assert_matches(out, expected)
    mine = weights.masked_fill(ids >= 4, 0.0)  # the same sum: the others weighted zero
    torch.testing.assert_close(expected, fused_moe_ref(x, gate_up, down, mine, ids.clamp(max=3)))
    torch.testing.assert_close(experts_grouped(x, gate_up, down, weights, local), expected)
    assert (local == 4).any() and (local < 4).any()


def test_fused_moe_strided_inputs():
    # x a column slice of a wider activation; gate_up stored [E, H, 2I] and seen transposed,
    # so the kernel must follow the weights' strides rather than assume contiguous rows.
    gate_up, down = make_layer(4, seed=5)
    x, weights, ids = make_routing(7, 2, list(range(4)), seed=6)
    wide = torch.cat([x, torch.randn(7, 8)], dim=1)[:, :HIDDEN]
    stored = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    assert stored.stride(2) != 1 and wide.stride(0) != HIDDEN
    assert_matches(*run_both(wide, stored, down, weights, ids))


def test_fused_moe_empty_batch():
    gate_up, down = make_layer(4, seed=7)
    x, weights, ids = make_routing(0, 2, list(range(4)), seed=8)
    out, expected = run_both(x, gate_up, down, weights, ids)
    assert out.shape == (0, HIDDEN) and expected.shape == (0, HIDDEN)


def test_reference_equals_the_model_expert_paths():
    # The oracle and both of moe.py's paths compute the same sum.
    gate_up, down = make_layer(8, seed=9)
    x, weights, ids = make_routing(13, 2, list(range(8)), seed=10)
    expected = fused_moe_ref(x, gate_up, down, weights, ids)
    for path in (experts_grouped, experts_gathered):
        torch.testing.assert_close(path(x, gate_up, down, weights, ids), expected)


def test_ops_dispatch():
    # Triton for CUDA tensors, the reference elsewhere: both equal the reference on CPU.
    gate_up, down = make_layer(4, seed=11)
    x, weights, ids = make_routing(6, 2, list(range(4)), seed=12)
    moved = [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]
    assert_matches(ops.fused_moe(*moved).cpu(), fused_moe_ref(x, gate_up, down, weights, ids))


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every pair once, each expert's run contiguous, in token order and padded to whole
    blocks of its own expert; the blocks past num_padded are padding with expert -1."""
    align = align_pairs(ids.to(DEVICE), num_experts, block_m)
    sorted_ids, experts = align.sorted_ids.cpu().long(), align.expert_ids.cpu().long()
    flat, pairs = ids.flatten(), ids.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = int((-(-counts // block_m) * block_m).sum())
    assert align.num_padded.item() == padded and sorted_ids.shape[0] % block_m == 0
    assert torch.equal(sorted_ids[sorted_ids < pairs].sort().values, torch.arange(pairs))
    assert (sorted_ids[padded:] == pairs).all() and (experts[padded // block_m :] == -1).all()
    blocks = sorted_ids[:padded].view(-1, block_m)
    for e in range(num_experts):
        run = blocks[experts[: padded // block_m] == e].flatten()
        real = run[run < pairs]
        assert run.numel() == -(-counts[e] // block_m) * block_m
        assert torch.equal(real, (flat == e).nonzero().flatten())  # all of e's, in order
    assert torch.equal(experts[: padded // block_m], experts[: padded // block_m].sort().values)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_pairs_invariants(block_m):
    _, _, ids = make_routing(33, 2, list(range(8)), seed=block_m)
    check_alignment(ids, 8, block_m)
    check_alignment(torch.full((5, 1), 2), 4, block_m)  # every token to one expert
    check_alignment(torch.tensor([[7, 0]]), 8, block_m)  # one token, six empty experts


def test_align_pairs_empty_and_deterministic():
    empty = align_pairs(torch.zeros(0, 2, dtype=torch.long, device=DEVICE), 4, 16)
    assert empty.sorted_ids.numel() == 0 and empty.num_padded.item() == 0
    _, _, ids = make_routing(33, 2, list(range(8)), seed=13)
    first, again = align_pairs(ids, 8, 4), align_pairs(ids, 8, 4)
    assert torch.equal(first.sorted_ids, again.sorted_ids)
    assert torch.equal(first.expert_ids, again.expert_ids)


def test_fused_moe_rejects_bad_inputs():
    gate_up, down = make_layer(4, seed=14)
    x, weights, ids = make_routing(3, 2, list(range(4)), seed=15)
    good = dict(x=x, gate_up=gate_up, down=down, weights=weights, ids=ids)
    bad_cases = [
        (dict(x=torch.randn(3, HIDDEN + 1)), "agree"),
        (dict(down=down[:, :, 1:]), "agree"),
        (dict(ids=ids[:2]), r"\[T, k\]"),
        (dict(weights=weights[:, :1]), r"\[T, k\]"),
        (dict(ids=ids.float()), "dtype"),
        (dict(x=x.half()), "share a dtype"),
        (dict(x=torch.randn(HIDDEN, 3).t()), "contiguous"),
        (dict(block_k=8), "16 or more"),
    ]
    for change, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            fused_moe_triton(**{**good, **change})

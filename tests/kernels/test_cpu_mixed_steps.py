"""The CPU paged attention over a run of steps as a server makes them, against the reference at
every step and layer: the test that would have caught the prefill tiles reverted in f3ce3b3
(right on one planned call, wrong in mixed batches over steps).

A small simulated server (`Run`) keeps a pool of blocks, handed out in random order and
poisoned with NaN when freed, and requests that join with a prefix shared from an earlier
request's blocks (read by both, written by neither), prefill in ragged chunks, decode, and
leave. Each step stores its new K/V rows with `store_kv`, then two layers (full attention and a
sliding window, as models that alternate them) attend with the same metadata tensors, as the
layers of a step do. Decode rows run through each path: the in-place kernel's AVX512 and plain
loops (cpu_attention) and the flash path they replaced.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.kernels import cpu, cpu_attention
from pdserve.kernels.cpu import paged_attention_cpu, store_kv
from pdserve.kernels.reference import paged_attention_ref

BLOCK_SIZE = 16
HEADS, KV_HEADS, DIM = 6, 2, 64  # grouped-query: 3 query heads a KV head
WINDOW = 24
STEPS = 14
# Prompts up to MAX_PROMPT tokens in chunks of up to MAX_CHUNK: some chunks pass 256 queries
# (the reverted tiles' size) over a cached prefix.
MAX_PROMPT, MAX_CHUNK = 300, 280


@dataclass
class Request:
    """One sequence: `done` tokens cached, `total` to reach before it only decodes, its blocks."""

    total: int
    done: int
    blocks: list[int]
    shared: int = 0  # leading blocks borrowed from another request (never written here)


@dataclass
class Run:
    """The pool, the live requests, one cache per layer, and the random source of it all."""

    rng: random.Random
    gen: torch.Generator
    dtype: torch.dtype
    num_blocks: int = 512
    free: list[int] = field(default_factory=list)
    live: list[Request] = field(default_factory=list)
    caches: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        self.rng.shuffle(self.free)
        shape = (2, 2, self.num_blocks, BLOCK_SIZE, KV_HEADS, DIM)  # layers, K/V, ...
        self.caches = list(torch.full(shape, float("nan"), dtype=self.dtype).unbind(0))

    def join(self) -> None:
        """A new request; half the time its prefix is the first full blocks of a live one."""
        total = self.rng.randint(1, MAX_PROMPT)
        donors = [r for r in self.live if r.done >= 2 * BLOCK_SIZE]
        if donors and self.rng.random() < 0.5:
            donor = self.rng.choice(donors)
            shared = self.rng.randint(1, donor.done // BLOCK_SIZE - 1)
            total = shared * BLOCK_SIZE + total
            self.live.append(Request(total, shared * BLOCK_SIZE, donor.blocks[:shared], shared))
        else:
            self.live.append(Request(total, 0, []))

    def leave(self, request: Request) -> None:
        """Free the blocks it owns, poisoned (a shared prefix stays with its owner). Blocks a
        later request borrowed from it are not freed: their borrower still reads them."""
        self.live.remove(request)
        borrowed = {b for r in self.live for b in r.blocks[: r.shared]}
        for block in request.blocks[request.shared :]:
            if block not in borrowed:
                for cache in self.caches:
                    cache[:, block] = float("nan")
                self.free.append(block)

    def schedule(self) -> list[tuple[Request, int]]:
        """Each live request's new tokens this step: a ragged prefill chunk, or one to decode."""
        out = []
        for r in self.live:
            left = r.total - r.done
            q_len = self.rng.randint(1, min(left, MAX_CHUNK)) if left > 0 else 1
            need = -(-(r.done + q_len) // BLOCK_SIZE) - len(r.blocks)
            r.blocks += [self.free.pop() for _ in range(need)]
            out.append((r, q_len))
        return out

    def step(self, window: int | None, check) -> None:
        """Store the step's K/V, attend on both layers with one set of metadata, check each."""
        batch = self.schedule()
        lens = [r.done + q for r, q in batch]
        width = max(len(r.blocks) for r, _ in batch) + 1
        tables = torch.full((len(batch), width), self.free[0], dtype=torch.int32)  # padding
        slots = []
        for i, (r, q) in enumerate(batch):
            tables[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
            slots += [r.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(r.done, r.done + q)]  # fmt: skip
        starts = torch.tensor([0] + [q for _, q in batch]).cumsum(0).int()
        meta = (tables, starts, torch.tensor(lens, dtype=torch.int32))
        tokens = int(starts[-1])
        for layer, cache in enumerate(self.caches):
            k, v = torch.randn(2, tokens, KV_HEADS, DIM, generator=self.gen).to(self.dtype)
            store_kv(k, v, cache[0], cache[1], torch.tensor(slots))
            query = torch.randn(tokens, HEADS, DIM, generator=self.gen).to(self.dtype)
            check(query, cache[0], cache[1], meta, window if layer else None)
        for r, q in batch:
            r.done += q


def check_float32(query, k_cache, v_cache, meta, window) -> None:
    out = paged_attention_cpu(query, k_cache, v_cache, *meta, DIM**-0.5, window)
    ref = paged_attention_ref(query, k_cache, v_cache, *meta, DIM**-0.5, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def check_bf16(query, k_cache, v_cache, meta, window) -> None:
    out = paged_attention_cpu(query, k_cache, v_cache, *meta, DIM**-0.5, window)
    assert out.dtype == torch.bfloat16
    # The reference on the same bf16 values in float32, rounded once.
    ref = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), *meta,
                              DIM**-0.5, window)  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def simulate(dtype: torch.dtype, seed: int, check) -> int:
    """STEPS steps of joins, chunks, decodes and leaves; returns how many decode rows ran."""
    run = Run(random.Random(seed), torch.Generator().manual_seed(seed), dtype)
    decodes = 0
    for step in range(STEPS):
        for _ in range(run.rng.randint(0, 2) if step else 3):
            run.join()
        finished = [r for r in run.live if r.done >= r.total and run.rng.random() < 0.2]
        for r in finished:
            run.leave(r)
        if not run.live:
            run.join()
        decodes += sum(r.done >= r.total for r in run.live)
        run.step(WINDOW, check)
    return decodes


@pytest.fixture(params=["avx512", "plain", "flash"])
def decode_path(request, monkeypatch) -> str:
    """Which path the decode rows take (prefill chunks take flash on all three)."""
    if request.param == "avx512" and not cpu_attention.uses_avx512(DIM):
        pytest.skip("no AVX512 on this CPU")
    if request.param == "plain":
        monkeypatch.setenv(cpu_attention.ATTENTION_KERNEL_ENV, "plain")
    if request.param == "flash":
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_steps_match_the_reference_in_float32(seed, decode_path):
    assert simulate(torch.float32, seed, check_float32) > 0  # decode rows did run


def test_mixed_steps_in_bf16_within_tolerance(decode_path):
    assert simulate(torch.bfloat16, 2, check_bf16) > 0


def test_mixed_steps_with_flash_chunks_of_one_block(monkeypatch):
    # Every flash chunk one block: every merge of partial results runs, decode rows included.
    monkeypatch.setattr(cpu, "CHUNK_BYTES", 64)
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    assert simulate(torch.float32, 3, check_float32) > 0

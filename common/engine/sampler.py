"""Turns one batch of logits into next tokens: bans, greedy, temperature, top-k/p, min-p, draws."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.common.wire.payloads import SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """How to sample one row of the logits batch.

    generator is the request's own (see make_generator), on the logits' device, so a seeded
    request draws the same tokens whatever else is batched with it; None uses the sampler's.
    banned_token_ids can never be chosen this step (e.g. EOS/stop ids before min_tokens).
    """

    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One chosen token per row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator seeded for one request, on the device its logits will live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def skip_draws(generator: torch.Generator, draws: int, vocab_size: int) -> None:
    """Advance `generator` past `draws` sampling steps over `vocab_size` tokens, exactly as
    many random numbers as `Sampler` takes from it per step, so a seeded request that moves
    between nodes goes on drawing where it left off."""
    for _ in range(draws):  # one call per step: a generator's stream depends on call shapes
        noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
        noise.exponential_(generator=generator)


class Sampler:
    """Picks the next token of every row of a [B, V] logits batch.

    Logprobs are those of the raw logits (before bans, temperature and truncation), like
    vLLM's default. Greedy rows take the argmax; the others are tempered, truncated by top-k,
    then top-p, then min-p, and drawn with the exponential race argmax(p / q), q ~ Exp(1),
    which needs no cumulative sums and gives each row's draw from that row's generator alone.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_mask: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """`grammar_mask`, for rows under a grammar: their indices and a [K, V] bool mask of the
        tokens each may take (the rest are banned before any sampling mode runs)."""
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows, {len(rows)} rows"
        raw = logits.float()
        allowed = _mask(_ban(raw, rows), raw, grammar_mask)
        token_ids = allowed.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            token_ids[sampled] = self._sample(allowed[sampled], [rows[i] for i in sampled])
        chosen = token_ids.tolist()
        return SamplerOutput(token_ids=chosen, logprobs=_logprobs(raw, rows, chosen))

    def verify(
        self,
        logits: torch.Tensor,
        row: SamplingRow,
        drafts: Sequence[int],
        allowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Speculative decoding's check of one request's k drafted tokens: logits [k + 1, V]
        are the target's at the request's last known token and at each draft. The tokens to
        emit: the drafts the target accepts, then its own token at the first rejection (or a
        bonus token after all k). Greedy rows accept a draft equal to the argmax. Sampled rows
        accept draft d with probability p(d) (p as `__call__` samples: tempered, truncated)
        and on rejection draw from p without d, renormalized: each emitted token is then
        distributed exactly as `__call__` would draw it (the drafts are point masses).
        `allowed`, for a request under a grammar: [k + 1, V] bool, the tokens its grammar
        allows at each position (after the drafts before it), as `__call__`'s grammar_mask."""
        assert logits.shape[0] == len(drafts) + 1, f"{logits.shape[0]} rows, {len(drafts)} drafts"
        raw = logits.float()
        rows = [row] * raw.shape[0]
        grammar_mask = None if allowed is None else (list(range(len(rows))), allowed)
        masked = _mask(_ban(raw, rows), raw, grammar_mask)
        if row.params.greedy:
            target = masked.argmax(dim=-1).tolist()
            chosen = target[: _agreed(target, drafts) + 1]
        else:
            chosen = self._speculate(self._probs(masked, rows), drafts, row.generator)
        n = len(chosen)
        return SamplerOutput(chosen, _logprobs(raw[:n], rows[:n], chosen))

    def _speculate(
        self, probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
    ) -> list[int]:
        """The rejection rule over probs [k + 1, V] (see `verify`)."""
        generator = generator or self.generator
        coins = torch.rand(len(drafts), generator=generator, device=generator.device).tolist()
        index = torch.tensor(list(drafts), device=probs.device)[:, None]
        p_drafts = probs[:-1].gather(-1, index).squeeze(-1).tolist()
        out: list[int] = []
        for i, (draft, p, coin) in enumerate(zip(drafts, p_drafts, coins, strict=True)):
            if coin >= p:  # rejected with probability 1 - p(d): the rest of p, without d
                residual = probs[i].clone()
                residual[draft] = 0.0
                return [*out, self._race(residual, generator)]
            out.append(draft)
        return [*out, self._race(probs[-1], generator)]

    def _race(self, probs: torch.Tensor, generator: torch.Generator) -> int:
        """One draw from (unnormalized) probs [V], as `_sample` draws a row."""
        q = _exponential(tuple(probs.shape), generator, probs)
        return int((probs / q.clamp_(min=torch.finfo(probs.dtype).tiny)).argmax())

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        probs = self._probs(logits, rows)
        # A zero draw would turn a masked token's 0/0 into NaN, which argmax would pick.
        q = self._exponentials(rows, probs).clamp_(min=torch.finfo(probs.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Each row's distribution to draw from: tempered, then truncated by top-k, top-p and
        min-p."""
        params = [row.params for row in rows]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(_top_k_on(p) or p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, params)
        if any(p.min_p > 0.0 for p in params):
            logits = _apply_min_p(logits, params)
        return logits.softmax(dim=-1)

    def _exponentials(self, rows: Sequence[SamplingRow], probs: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise shaped like probs; a row with a generator draws only from it."""
        q = torch.empty_like(probs)
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        if shared:
            q[shared] = _exponential((len(shared), probs.shape[1]), self.generator, probs)
        for i, row in enumerate(rows):
            if row.generator is not None:
                q[i] = _exponential((probs.shape[1],), row.generator, probs)
        return q


def _exponential(
    shape: tuple[int, ...], generator: torch.Generator, like: torch.Tensor
) -> torch.Tensor:
    # Drawn on the generator's own device: a generator cannot feed a tensor elsewhere.
    noise = torch.empty(shape, dtype=like.dtype, device=generator.device)
    return noise.exponential_(generator=generator).to(like.device)


def _agreed(target: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n


def _ban(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """A copy of logits with every row's banned ids at -inf; the raw logits stay intact."""
    row_idx = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
    if not row_idx:
        return logits
    col_idx = [t for row in rows for t in row.banned_token_ids]
    banned = logits.clone()
    banned[row_idx, col_idx] = float("-inf")
    return banned


def _mask(
    logits: torch.Tensor, raw: torch.Tensor, grammar_mask: tuple[list[int], torch.Tensor] | None
) -> torch.Tensor:
    """logits with every token a grammar forbids at -inf (a copy: raw stays intact)."""
    if grammar_mask is None:
        return logits
    indices, mask = grammar_mask
    out = logits.clone() if logits is raw else logits
    if len(indices) == out.shape[0]:  # every row constrained: in place, no gather/scatter
        return out.masked_fill_(~mask, float("-inf"))
    out[indices] = out[indices].masked_fill(~mask, float("-inf"))
    return out


def _top_k_on(params: SamplingParams) -> bool:
    return params.top_k > 0


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Keeps each row's top_k best tokens, then the smallest head whose mass reaches top_p."""
    vocab = logits.shape[1]
    device = logits.device
    top_k = torch.tensor([p.top_k if _top_k_on(p) else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)
    ordered = ordered.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the best token: it always stays
    # top_p == 1 is "off": rounding must not drop tail tokens whose mass_before creeps to 1.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


def _apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drops tokens less likely than min_p times the row's most likely token."""
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)
    probs = logits.softmax(dim=-1)
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


def _logprobs(
    raw: torch.Tensor, rows: Sequence[SamplingRow], chosen: list[int]
) -> list[TokenLogprobs | None]:
    """Chosen-token and top-N logprobs of the raw distribution, for rows that asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return out
    top_n = max(rows[i].params.logprobs or 0 for i in wanted)
    scored = score_tokens(raw[wanted], [chosen[i] for i in wanted], top_n, ranked=False)
    for i, lp in zip(wanted, scored, strict=True):
        n = rows[i].params.logprobs or 0
        out[i] = TokenLogprobs(lp.token_id, lp.logprob, lp.top[:n])
    return out


def score_tokens(
    logits: torch.Tensor, token_ids: Sequence[int], top_n: int, ranked: bool = True
) -> list[TokenLogprobs]:
    """Row i's log-softmax at token_ids[i], its rank (1: the most likely; 0 unless `ranked`),
    and the top_n alternatives: how prompt tokens and sampled tokens are scored alike."""
    logprobs = logits.float().log_softmax(dim=-1)
    index = torch.tensor(list(token_ids), device=logits.device)[:, None]
    chosen = logprobs.gather(-1, index)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist() if ranked else [0] * len(token_ids)
    chosen_lp = chosen.squeeze(-1).tolist()
    top_lp, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0],) * 2
    out = []
    for i, token in enumerate(token_ids):
        top = tuple(zip(top_ids[i].tolist(), top_lp[i].tolist(), strict=True))
        out.append(TokenLogprobs(int(token), chosen_lp[i], top, ranks[i]))
    return out

"""The request sequences of `pdserve bench kv-tiers`, as prompts of token ids (every system
sees the same ones; the engine computes one token of each, the TTFT).

- `multiturn`: conversations in round robin, each turn the previous prompt, an answer and a
  new message (fixed tokens appended to the history), so the pool evicts a conversation's
  history before its next turn.
- `prefix`: a few long documents asked about in turn, each question new: the pool holds less
  than the documents together.
- `trace`: kvcache-ai/Mooncake's FAST'25 conversation trace (`FAST25-release/traces/
  conversation_trace.jsonl`; its first 400 requests ship in scripts/data), lengths scaled to
  this machine, each hash id one fixed random block (`pdserve bench replay`'s synthesis), so
  the prefix sharing is the trace's.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

from pdserve.bench import replay

TRACE = Path(__file__).resolve().parents[2] / "scripts" / "data" / "mooncake_conversation_400.jsonl"
QUESTION_LEN = 32  # prefix: the tokens of each new question after its document


class RandomIds:
    """Token ids drawn from [100, vocab) (no special ids), for prompts nobody reads."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def token_ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(100, self.vocab) for _ in range(n)]


def multiturn(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng, ids = random.Random(args.seed), RandomIds(vocab)
    history = [ids.token_ids(rng, args.first_len) for _ in range(args.conversations)]
    prompts = []
    for turn in range(args.turns):
        for conv in history:
            if turn:  # the previous answer and a new message
                conv += ids.token_ids(rng, 2 * args.message_len)
            prompts.append(list(conv))
    return prompts


def prefix(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng, ids = random.Random(args.seed + 1), RandomIds(vocab)
    documents = [ids.token_ids(rng, args.document_len) for _ in range(args.documents)]
    return [
        doc + ids.token_ids(rng, QUESTION_LEN) for _ in range(args.questions) for doc in documents
    ]


def trace(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    path = Path(args.trace) if args.trace else TRACE
    if not path.is_file():
        raise ValueError(f"no trace at {path}: pass --trace (a Mooncake-format .jsonl)")
    with path.open() as f:
        requests = replay.parse(f)[: args.trace_requests]
    scaled = [replay.scaled(r, 1.0, args.length_scale, 1.0) for r in requests]
    ids = RandomIds(vocab)
    return [replay.synthesize(r, i, ids, args.seed) for i, r in enumerate(scaled)]


WORKLOADS: dict[str, Callable[[argparse.Namespace, int], list[list[int]]]] = {
    "multiturn": multiturn,
    "prefix": prefix,
    "trace": trace,
}

"""`create_proposer`: the drafter a `SpeculativeConfig` names, through a registry."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.common.spec.base import Proposer
from pdserve.common.spec.config import SpeculativeConfig
from pdserve.common.spec.ngram import NgramProposer
from pdserve.common.spec.suffix import SuffixProposer

__all__ = ["PROPOSERS", "Proposer", "create_proposer"]

PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}


def create_proposer(config: SpeculativeConfig) -> Proposer:
    """A fresh drafter for one engine (its per-request and cross-request state start empty)."""
    if config.has_draft_kv:  # DraftModelProposer: it needs the runner's model and caches
        raise ValueError(
            f"speculative_config.method: {config.method}'s proposer is built by the engine"
        )
    factory = PROPOSERS.get(config.method)
    if factory is None:
        raise ValueError(f"speculative_config.method: no proposer for {config.method!r}")
    return factory(config)

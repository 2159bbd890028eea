"""Facts with one home: "score the prompt only" is `SamplingParams.scores_prompt_only`, the
model families' names are `common/model/families.py`'s, and block hashes are chained by
`extend_block_hashes` alone (engine and router)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.engine.kv_cache_manager import extend_block_hashes, hash_token_blocks
from pdserve.common.model import families
from pdserve.common.wire.payloads import SamplingParams
from pdserve.router.cluster.streams import BlockHashes

REPO = Path(__file__).resolve().parents[2]
PACKAGE = ("common", "kernels", "kv_transfer", "prefill_node", "decode_node", "router")


def sources() -> dict[str, str]:
    """The package's modules (pdserve/bench aside: its HF config dicts are data), by path."""
    paths = [p for d in PACKAGE for p in (REPO / d).rglob("*.py")]
    paths += (REPO / "pdserve").glob("*.py")
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in paths}


def homes(needle: str) -> list[str]:
    return sorted(path for path, text in sources().items() if needle in text)


def test_scoring_a_prompt_is_one_property() -> None:
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    assert scored.scores_prompt_only and not SamplingParams(max_tokens=1).scores_prompt_only
    with pytest.raises(ValueError, match="needs echo or prompt_logprobs"):
        SamplingParams(max_tokens=0)
    assert homes("max_tokens == 0") == ["common/wire/payloads.py"]


def test_every_family_name_is_written_in_families_only() -> None:
    names = families.SUPPORTED_ARCHITECTURES
    assert set(families.MOE_ARCHITECTURES) | set(families.QK_NORM_ARCHITECTURES) <= set(names)
    for name in names:
        assert homes(f'"{name}"') == ["common/model/families.py"], name


def test_block_hashes_are_chained_in_one_place_and_extend_as_tokens_come() -> None:
    tokens = list(range(1, 12))
    whole = hash_token_blocks(tokens, 4)
    grown: list[bytes] = []
    for n in range(len(tokens) + 1):  # one token at a time, as a request grows
        assert extend_block_hashes(grown, tokens, 4, n) == whole[: n // 4]
    assert BlockHashes(tokens).of(4) == whole == grown
    assert homes("hash_block_tokens(") == ["common/engine/kv_cache_manager.py"]

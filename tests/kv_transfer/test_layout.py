"""KVLayout: validation, canonical digest, mismatch descriptions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.kv_transfer import KVLayout

LAYOUT = KVLayout("m", "bfloat16", num_layers=2, num_kv_heads=4, head_dim=64, block_size=16)


def test_digest_is_stable_and_field_sensitive() -> None:
    assert LAYOUT.digest() == KVLayout.from_dict(LAYOUT.to_dict()).digest()
    assert len(LAYOUT.digest()) == 64
    others = [
        replace(LAYOUT, model_id="n"),
        replace(LAYOUT, dtype="float16"),
        replace(LAYOUT, num_layers=3),
        replace(LAYOUT, num_kv_heads=8),
        replace(LAYOUT, head_dim=128),
        replace(LAYOUT, block_size=32),
    ]
    assert len({LAYOUT.digest(), *(o.digest() for o in others)}) == 7


def test_describe_mismatch_names_each_field_and_both_values() -> None:
    assert LAYOUT.describe_mismatch(LAYOUT) == ""
    text = LAYOUT.describe_mismatch(replace(LAYOUT, dtype="float32", block_size=8), ("P", "D"))
    assert "dtype: P 'bfloat16' != D 'float32'" in text
    assert "block_size: P 16 != D 8" in text
    assert "head_dim" not in text


@pytest.mark.parametrize(
    "override",
    [{"dtype": "float64"}, {"num_layers": 0}, {"head_dim": True}, {"model_id": ""}],
)
def test_invalid_layouts_are_refused(override: dict) -> None:
    with pytest.raises(ValueError):
        replace(LAYOUT, **override)


def test_from_dict_is_strict() -> None:
    with pytest.raises(ValueError, match="exactly the fields"):
        KVLayout.from_dict({**LAYOUT.to_dict(), "extra": 1})
    with pytest.raises(ValueError):
        KVLayout.from_dict({k: v for k, v in LAYOUT.to_dict().items() if k != "dtype"})


def test_page_geometry() -> None:
    assert LAYOUT.page_shape(3) == (2, 3, 16, 4, 64)
    assert LAYOUT.page_bytes == 2 * 16 * 4 * 64 * 2

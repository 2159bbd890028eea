"""Our kernels live at `pdserve.kernels`: nothing named `kernels` is installed by pdserve, so
transformers can never take it for Hugging Face's `kernels` library (it probes
`find_spec("kernels")` and the distribution that owns that import name)."""

from __future__ import annotations

import importlib.metadata

from transformers.utils import import_utils


def test_transformers_does_not_take_our_kernels_for_the_hub_library() -> None:
    assert not import_utils.is_kernels_available()


def test_pdserve_owns_no_top_level_name_but_pdserve() -> None:
    owned = sorted(
        name
        for name, dists in importlib.metadata.packages_distributions().items()
        if "pdserve" in dists
    )
    assert owned == ["pdserve"], owned

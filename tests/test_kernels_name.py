"""Our top-level `kernels` package must not pass for Hugging Face's `kernels` library.

transformers probes `importlib.util.find_spec("kernels")`, which finds our package, then asks
for a version: there is no "kernels" distribution, so it falls back to the distribution that
owns the import name, ours ("pdserve"). It believes the hub library is installed only when that
version lies in [KERNELS_MIN_VERSION, KERNELS_MAX_VERSION); believing it would make transformers
import `kernels.get_kernel` and hub-kernel integrations from our package and crash. Only our
version being below KERNELS_MIN_VERSION keeps it out, so a version bump must fail here first.
"""

from __future__ import annotations

import importlib.metadata

from packaging import version
from transformers.utils import import_utils


def test_transformers_does_not_take_our_kernels_for_the_hub_library() -> None:
    assert not import_utils.is_kernels_available()


def test_our_version_is_what_transformers_sees_and_below_the_minimum() -> None:
    ours = importlib.metadata.version("pdserve")
    found, seen = import_utils._is_package_available("kernels", return_version=True)
    assert found and seen == ours, "transformers resolved `kernels` to another distribution"
    assert version.parse(ours) < version.parse(import_utils.KERNELS_MIN_VERSION), (
        f"pdserve {ours} >= KERNELS_MIN_VERSION {import_utils.KERNELS_MIN_VERSION}: "
        "transformers would take our `kernels` package for Hugging Face's"
    )

"""The device the device-aware tests run on: `PDSERVE_TEST_DEVICE=cuda scripts/test.sh ...`.

CPU by default (CI has no GPU). On CUDA the Triton tests compile their kernels for real instead
of running them in the interpreter, and the HF-equivalence and compiled-decode tests run the
engine on the GPU against the same CPU float32 references.
"""

from __future__ import annotations

import os

import pytest

TEST_DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
ON_CUDA = TEST_DEVICE.startswith("cuda")

if TEST_DEVICE != "cpu" and not ON_CUDA:
    raise ValueError(f"PDSERVE_TEST_DEVICE must be cpu or cuda[:N]; got {TEST_DEVICE!r}")


def require_device() -> None:
    """Fail (not skip) when CUDA was asked for and is not there: a GPU run must not pass empty."""
    if ON_CUDA:
        import torch

        if not torch.cuda.is_available():
            pytest.fail(f"PDSERVE_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device")


# Engines the tests compare with HF float32 (or with each other's float32 greedy output) ask for
# float32: the default is `--dtype auto`, bf16 on CUDA and on CPUs with native bf16.
REFERENCE_DTYPE = "float32"

# On one GPU every engine of a test (the in-process reference, each node process) shares the
# card: a fixed pool instead of 85% of what is free, and few decode buckets to compile.
_CUDA_ENGINE = {"device": TEST_DEVICE, "max_num_seqs": 8, "num_blocks": 2048}


def engine_kwargs() -> dict[str, object]:
    """`LLM(...)` keyword arguments that put an in-process engine on the test device, in
    float32."""
    return {"dtype": REFERENCE_DTYPE, **(_CUDA_ENGINE if ON_CUDA else {})}


def engine_flags() -> list[str]:
    """The node flags that put a node process on the test device, in float32."""
    return [x for k, v in engine_kwargs().items() for x in (f"--{k.replace('_', '-')}", str(v))]

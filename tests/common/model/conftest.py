"""What the compile tests share across modules: the suite's one cold background compile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def gguf_switch(
    tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    """The tiny Llama as a Q4_1 GGUF (float32: the GEMV's exact AVX2 path, so eager's tokens
    are the oracle), started with `--compile-mode background` under a root of its own: one
    request decoded across the cold compile of bucket 1 (test_background_compile.Switch).

    test_background_compile.py (the switch, a warm second start) and test_gguf_compile.py
    (the GEMV's ops in the package) read this one compile (35 CPU s cold, docs/testing.md);
    both modules are one xdist group, so two workers do not compile it twice."""
    from gguf import GGMLQuantizationType

    from tests.common.model.test_background_compile import switch_mid_stream
    from tests.common.model.test_gguf import write_llama_gguf

    folder = tmp_path_factory.mktemp("gguf-background-compile")
    path = write_llama_gguf(tiny_model_dir("llama"), folder / "m.gguf", GGMLQuantizationType.Q4_1)
    with switch_mid_stream(str(path), folder / "cache") as switch:
        yield switch

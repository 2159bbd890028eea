"""The handover between a background compile and the engine's step (common/engine/
compiled_decode.py `ReadyBuckets`): the compile takes the bucket the step used most, and each
package it loads reaches the step once. The children here are stand-ins that exit at once."""

from __future__ import annotations

import sys
from pathlib import Path

from pdserve.common.engine.background_compile import BackgroundCompile, CompileJob
from pdserve.common.engine.compiled_decode import ReadyBuckets
from pdserve.common.engine.config import ModelConfig


class Succeeds(BackgroundCompile):
    """A compile whose child exits 0 at once; `load` stands in the package."""

    def command(self, job: CompileJob) -> list[str]:
        return [sys.executable, "-c", "pass"]


def test_the_most_used_bucket_is_compiled_first_the_smallest_on_a_tie() -> None:
    ready = ReadyBuckets()
    for size in (4, 4, 2):
        ready.note(size)
    assert ready.most_used([1, 2, 4]) == 4
    assert ready.most_used([1, 2]) == 2
    assert ready.most_used([1, 8]) == 1


def test_each_package_reaches_the_step_once_in_the_order_of_use(tmp_path: Path) -> None:
    ready = ReadyBuckets()
    for size in (4, 4, 2):
        ready.note(size)
    (tmp_path / "d").mkdir()
    job = CompileJob(ModelConfig(str(tmp_path)), "{}", str(tmp_path), "d", 1, 0)
    background = Succeeds(job, (1, 2, 4), "package {}".format, ready)
    assert background.wait(60)
    assert background.compiled == [4, 2, 1] and background.failed == []
    assert ready.take() == {4: "package 4", 2: "package 2", 1: "package 1"}
    assert ready.take() == {}

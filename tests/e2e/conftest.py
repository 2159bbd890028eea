"""Fixtures the end-to-end modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_tracing import Receiver


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver of the module's own, for its traced deployments."""
    r = Receiver()
    yield r
    r.close()

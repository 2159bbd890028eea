"""pdserve: prefill/decode disaggregated LLM inference for Llama-family models.

`from pdserve import LLM, SamplingParams` is the offline API. The two names load lazily, so
that importing a light subpackage (the router never loads torch) does not pull in the engine.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("pdserve")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from pdserve.common.engine.llm import LLM, RequestOutput
    from pdserve.common.wire.payloads import SamplingParams

_LAZY = {
    "LLM": "pdserve.common.engine.llm",
    "RequestOutput": "pdserve.common.engine.llm",
    "SamplingParams": "pdserve.common.wire.payloads",
}

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)

"""kvserve: a KV-cache-centred LLM inference engine.

The public names load on first use, so ``import kvserve.kv`` (pure bookkeeping) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine import LLMEngine
    from kvserve.llm import LLM
    from kvserve.outputs import CompletionOutput, RequestOutput
    from kvserve.sampling_params import SamplingParams
    from kvserve.structured.params import GuidedDecodingParams

_EXPORTS = {
    "LLM": "kvserve.llm",
    "LLMEngine": "kvserve.engine",
    "CompletionOutput": "kvserve.outputs",
    "RequestOutput": "kvserve.outputs",
    "SamplingParams": "kvserve.sampling_params",
    "GuidedDecodingParams": "kvserve.structured.params",
}

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams", "GuidedDecodingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")

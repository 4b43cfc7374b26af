"""kvserve: a KV-cache-centred LLM inference engine.

The public names load on first use, so ``import kvserve.kv`` (pure bookkeeping) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.core.engine import LLMEngine
    from kvserve.core.outputs import CompletionOutput, RequestOutput
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling.sampling_params import SamplingParams
    from kvserve.structured.params import GuidedDecodingParams

_EXPORTS = {
    "LLM": "kvserve.entrypoints.llm",
    "LLMEngine": "kvserve.core.engine",
    "CompletionOutput": "kvserve.core.outputs",
    "RequestOutput": "kvserve.core.outputs",
    "SamplingParams": "kvserve.sampling.sampling_params",
    "GuidedDecodingParams": "kvserve.structured.params",
}

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams", "GuidedDecodingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")

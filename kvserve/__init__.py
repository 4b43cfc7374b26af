"""kvserve: a KV-cache-centred LLM inference engine."""

from kvserve.engine import LLMEngine
from kvserve.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

"""kvserve: a KV-cache-centred LLM inference engine."""

from kvserve.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"

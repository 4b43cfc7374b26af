"""Structured output (guided decoding): constraints a request's output must match, enforced by xgrammar."""

from kvserve.structured.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]

"""LongRoPE (Ding et al., 2024, https://arxiv.org/abs/2402.13753), the rotary scaling of Phi-3 / Phi-3.5.

Each frequency is divided by its own factor, from one of two sets: ``short_factor``, searched for contexts up to
the pretraining length (``original_max_position_embeddings``), and ``long_factor``, for the extended context; cos
and sin are multiplied by ``attention_factor`` (by default sqrt(1 + ln(context / original) / ln(original))) with
either set.

Which set runs. transformers picks per forward pass: long factors once the pass holds a position past the original
context, short ones otherwise, and re-rotates the whole sequence when it recomputes. A paged cache rotates each
key once, when it is written, so kvserve fixes the set per model as llama.cpp does per context: long factors when
the context the model runs at (``max_position_embeddings``, the rotary table's length) exceeds
``original_max_position_embeddings``, short factors otherwise. So a Phi-3-mini-128k or Phi-3.5-mini runs every
sequence with long factors: those past 4096 tokens match transformers at every position, shorter ones get the
long-context rotation where transformers would use the short factors (as llama.cpp does when run at the model's
full context). ``max_model_len`` caps request lengths without changing the set. A model whose context is its
original one runs the short factors and matches transformers everywhere.
"""

from __future__ import annotations

import torch

from kvserve.errors import UnsupportedModelError
from kvserve.models.config import ModelConfig
from kvserve.models.layers import RotaryEmbedding, rope_inverse_frequencies


def uses_long_factors(config: ModelConfig) -> bool:
    """Whether ``config``'s LongRoPE runs its long factors (see the module docstring)."""
    return config.max_position_embeddings > config.rope_scaling.original_max_position_embeddings


def longrope_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The rotary table of a ``longrope`` config: inverse frequencies divided by the chosen factor set, cos and
    sin scaled by the attention factor (as transformers scales them, in float32 before the cast)."""
    scaling = config.rope_scaling
    factors = scaling.long_factor if uses_long_factors(config) else scaling.short_factor
    if len(scaling.short_factor) != config.head_dim // 2 or len(scaling.long_factor) != config.head_dim // 2:
        raise UnsupportedModelError(
            f"LongRoPE needs head_dim / 2 = {config.head_dim // 2} factors per set, got "
            f"{len(scaling.short_factor)} short and {len(scaling.long_factor)} long"
        )
    divisors = torch.tensor(factors, dtype=torch.float64)
    rotary = RotaryEmbedding(
        rope_inverse_frequencies(config.head_dim, config.rope_theta, None, divisors), config.max_position_embeddings
    )
    rotary.cos.mul_(scaling.attention_factor)
    rotary.sin.mul_(scaling.attention_factor)
    return rotary

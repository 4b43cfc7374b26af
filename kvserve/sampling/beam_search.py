"""Beam search over a request's live beams (vLLM's ``use_beam_search``, as it had it before v1).

Each step every live beam proposes its ``2 * width`` most likely next tokens; the best ``width``
candidates by cumulative log-probability continue. A candidate ending in a stop token becomes a
finished hypothesis scored with the length penalty. The search ends when ``width`` hypotheses are
finished and no live beam can still beat the worst of them (``early_stopping=False`` semantics
with a monotone bound, as Hugging Face and vLLM use), or when beams run out of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidate:
    parent: int  # index of the beam it extends
    token_id: int
    logprob: float  # of token_id
    cumulative_logprob: float


def beam_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """Hugging Face's length-normalised score of a hypothesis of ``length`` generated tokens."""
    return cumulative_logprob / (max(length, 1) ** length_penalty)


def propose(logprobs: torch.Tensor, cumulative: Seq[float], width: int) -> list[Candidate]:
    """logprobs (beams, vocab) of the live beams -> the best ``2 * width`` candidates, best first."""
    scores = logprobs + torch.tensor(cumulative, dtype=logprobs.dtype).unsqueeze(1)
    k = min(2 * width, scores.numel())
    values, flat = torch.topk(scores.flatten(), k)
    vocab = logprobs.shape[1]
    return [
        Candidate(int(i) // vocab, int(i) % vocab, float(logprobs[int(i) // vocab, int(i) % vocab]), float(v))
        for v, i in zip(values, flat, strict=True)
    ]


def is_done(
    finished_scores: Seq[float], best_live_cumulative: float, live_length: int, width: int, length_penalty: float
) -> bool:
    """True when ``width`` hypotheses are finished and the best live beam cannot beat the worst of them."""
    if len(finished_scores) < width:
        return False
    worst_kept = sorted(finished_scores, reverse=True)[width - 1]
    return beam_score(best_live_cumulative, live_length, length_penalty) <= worst_kept

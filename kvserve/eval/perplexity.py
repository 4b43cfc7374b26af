"""Perplexity over a text with sliding windows (the transformers perplexity recipe).

Each window holds up to ``context`` tokens and scores only the tokens the previous window did not,
so every token but the first is scored once, with at least ``context - stride`` tokens of history
(except in the first window).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvserve.eval.loglikelihood import LoglikelihoodRequest, Scorer
from kvserve.eval.metrics import perplexity


@dataclass(frozen=True)
class Window:
    begin: int  # first token of the window
    end: int  # one past its last token
    scored_from: int  # tokens [scored_from, end) are scored


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} tokens; perplexity needs at least 2")
    end = min(context, num_tokens)
    windows = [Window(0, end, 1)]
    while end < num_tokens:
        new_end = min(end + stride, num_tokens)
        begin = max(0, new_end - context)
        if begin >= end:  # stride == context: keep one token of history so no token goes unscored
            begin = end - 1
            new_end = min(begin + context, num_tokens)
        windows.append(Window(begin, new_end, end))
        end = new_end
    return windows


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # total negative log-likelihood (nats)
    scored_tokens: int
    num_windows: int
    processed_tokens: int  # tokens run through the model: windows overlap by context - stride
    words: int
    bytes: int
    seconds: float

    @property
    def word_perplexity(self) -> float:
        return math.exp(self.nll / self.words)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / self.bytes / math.log(2)

    @property
    def tokens_per_second(self) -> float:
        return self.scored_tokens / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict[str, float | int]:
        return {
            "perplexity": self.perplexity,
            "word_perplexity": self.word_perplexity,
            "bits_per_byte": self.bits_per_byte,
            "nll": self.nll,
            "scored_tokens": self.scored_tokens,
            "num_windows": self.num_windows,
            "processed_tokens": self.processed_tokens,
            "words": self.words,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
        }


def evaluate_perplexity(scorer: Scorer, tokens: list[int], text: str, context: int, stride: int) -> PerplexityResult:
    """Score ``tokens`` (the tokenisation of ``text``). Word and byte counts come from ``text``, so
    word perplexity and bits per byte cover the same span as the token perplexity."""
    windows = sliding_windows(len(tokens), context, stride)
    requests = [
        LoglikelihoodRequest(tuple(tokens[w.begin : w.scored_from]), tuple(tokens[w.scored_from : w.end]))
        for w in windows
    ]
    start = time.perf_counter()
    scores = scorer.loglikelihood(requests)
    seconds = time.perf_counter() - start
    total = sum(s.logprob for s in scores)
    count = sum(s.num_tokens for s in scores)
    return PerplexityResult(
        perplexity=perplexity(total, count),
        nll=-total,
        scored_tokens=count,
        num_windows=len(windows),
        processed_tokens=sum(w.end - w.begin for w in windows),
        words=max(len(text.split()), 1),
        bytes=max(len(text.encode()), 1),
        seconds=seconds,
    )

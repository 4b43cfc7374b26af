"""Benchmark workloads: request lengths replayed from the Azure LLM inference trace, on real text."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from kvserve.eval.data import AUSTEN, AZURE_CONV_TRACE
from kvserve.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class TraceRequest:
    prompt_ids: list[int]
    output_len: int


def load_trace_requests(
    tokenizer: Tokenizer,
    num_requests: int,
    scale: float,
    max_model_len: int,
    trace: Path = AZURE_CONV_TRACE,
    text: Path = AUSTEN,
    seed: int = 0,
) -> list[TraceRequest]:
    """The first ``num_requests`` rows of the trace, context and generated lengths divided by ``scale``.

    Prompts are slices of real text (Austen) at seeded random offsets, so prompts differ and the
    prefix cache does not turn the benchmark into a cache test.
    """
    for path in (trace, text):
        if not path.is_file():
            raise ValueError(f"benchmark data {path} is missing")
    with trace.open() as f:
        rows = [row for _, row in zip(range(num_requests), csv.DictReader(f), strict=False)]
    lengths = []
    for row in rows:
        output_len = max(1, round(int(row["GeneratedTokens"]) / scale))
        prompt_len = max(1, min(round(int(row["ContextTokens"]) / scale), max_model_len - output_len - 1))
        lengths.append((prompt_len, output_len))
    pool = _token_pool(tokenizer, text, max(p for p, _ in lengths) * 4)
    rng = random.Random(seed)
    requests = []
    for prompt_len, output_len in lengths:
        start = rng.randrange(0, len(pool) - prompt_len)
        requests.append(TraceRequest(pool[start : start + prompt_len], output_len))
    return requests


def fixed_length_prompts(
    tokenizer: Tokenizer, count: int, length: int, text: Path = AUSTEN, seed: int = 1
) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` tokens of real text."""
    pool = _token_pool(tokenizer, text, count * length * 2)
    starts = random.Random(seed).sample(range(len(pool) - length), count)
    return [pool[s : s + length] for s in starts]


def _token_pool(tokenizer: Tokenizer, text: Path, min_tokens: int) -> list[int]:
    content = text.read_text(errors="replace")
    chars = min_tokens * 6
    ids = tokenizer.encode(content[:chars], add_special_tokens=False)
    if len(ids) < min_tokens:
        raise ValueError(f"{text} gives {len(ids)} tokens; the workload needs {min_tokens}")
    return ids

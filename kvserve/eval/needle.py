"""Needle in a haystack: can the model repeat one planted fact from anywhere in a long Austen text?

The design, fixed so that runs compare (across dtypes, KV policies, budgets):

- **Haystack**: the opening of the Austen text (``eval.data.AUSTEN``, *Emma* first), with the
  hard line wraps of each paragraph joined into one line and paragraphs kept apart by a blank line.
  Every cell of one length uses the *same* haystack: its first ``n`` tokens, decoded back to text.
- **Needle**: one sentence, ``The secret passphrase for the vault is 'amber-falcon-731'.``, whose
  value (adjective-animal-number) is drawn from ``random.Random(f"{seed}:{length}:{depth}")``:
  a different value per cell, the same value in every run with the same seed.
- **Depth**: the fraction of the haystack's tokens before the needle. The requested depth picks a
  token position; the needle goes in at the sentence boundary nearest to it in characters: after
  ``.``, ``!`` or ``?`` and any closing quote, before whitespace (not after Mr., Mrs., Ms., Dr.,
  St.), or at a paragraph's end; the very start and end of the haystack count as boundaries too.
  The depth reached is recorded per cell.
- **Prompt**: one user turn through the model's chat template, with the generation prompt::

      Read the following text and answer the question after it.

      <text>
      {haystack with the needle}
      </text>

      What is the secret passphrase for the vault? Answer with the passphrase only.

- **Length**: counts *the whole prompt in tokens*: chat template (system prompt and role markers
  included), instruction, haystack, needle and question. The haystack gets what the rest leaves;
  if joining the pieces tokenises a few tokens longer than that, the haystack is cut shorter, so
  every prompt of a length is at most that length (in practice within a few tokens of it).
- **Answer**: greedy (temperature 0), at most ``max_tokens`` tokens (32 by default). A length must
  leave those tokens free in the model's context, else ValueError.
- **Score**: 1 when the needle's value appears verbatim in the answer (compared case-insensitively,
  since the value is lower-case and a capitalised first letter is not a retrieval error), else 0.

The tokens before the needle are the same for every depth of one length, so the engine's prefix
cache computes the template and the shared start of the haystack once; all cells go to the engine
in one batch.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.eval.data import AUSTEN, require
from kvserve.platform.extras import pyplot
from kvserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.core.engine import LLMEngine

NEEDLE_MAX_TOKENS = 32
NEEDLE_SEED = 0
NEEDLE_TEMPLATE = "The secret passphrase for the vault is '{value}'."
INSTRUCTION = "Read the following text and answer the question after it."
QUESTION = "What is the secret passphrase for the vault? Answer with the passphrase only."

_ADJECTIVES = (
    "amber", "azure", "bold", "brisk", "calm", "crimson", "dusty", "eager", "frosty", "gentle", "golden", "hidden",
    "hollow", "ivory", "jade", "lively", "lunar", "misty", "noble", "olive", "quiet", "rapid", "rusty", "scarlet",
    "silver", "solar", "swift", "tawny", "velvet", "violet", "wild", "young",
)  # fmt: skip
_ANIMALS = (
    "badger", "beaver", "bison", "cobra", "crane", "falcon", "ferret", "gecko", "heron", "ibis", "jackal", "koala",
    "lemur", "lynx", "marten", "moose", "newt", "ocelot", "otter", "panda", "puffin", "quail", "raven", "salmon",
    "stoat", "tapir", "toucan", "walrus", "weasel", "wombat", "yak", "zebra",
)  # fmt: skip
# The end of a sentence: terminal punctuation and any closing quotes, brackets or italics marks,
# followed by whitespace (the boundary is the position right after the punctuation); or the end of a
# paragraph (a heading such as ``CHAPTER I`` has no full stop). Titles (Mr., Mrs., ...) end no sentence.
_SENTENCE_END = re.compile(r"(?<!\bMr)(?<!\bMrs)(?<!\bMs)(?<!\bDr)(?<!\bSt)[.!?][\"')\]_]*(?=\s)|(?<=\S)(?=\n\n)")


@dataclass(frozen=True)
class NeedleCell:
    """One prompt of the grid: a haystack length, a needle depth, and what was planted where."""

    length: int  # requested prompt length in tokens
    depth: float  # requested depth, fraction of the haystack before the needle
    value: str  # the passphrase the answer must contain
    prompt_ids: list[int]
    actual_depth: float  # haystack tokens before the needle / haystack tokens
    haystack_tokens: int


def needle_value(seed: int, length: int, depth: float) -> str:
    """The passphrase of one cell, e.g. ``amber-falcon-731``: seeded, so every run plants the same ones."""
    rng = random.Random(f"{seed}:{length}:{depth:.6f}")
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_ANIMALS)}-{rng.randrange(100, 1000)}"


def score_answer(answer: str, value: str) -> float:
    """1.0 when ``value`` appears verbatim in ``answer`` (case-insensitive), else 0.0."""
    return float(value.lower() in answer.lower())


def clean_text(raw: str) -> str:
    """Join each paragraph's wrapped lines into one; paragraphs stay apart by a blank line."""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", raw))
    return "\n\n".join(p for p in paragraphs if p)


def sentence_boundaries(text: str) -> list[int]:
    """Character offsets where a needle may go: 0, after every sentence or paragraph end, and ``len(text)``."""
    return sorted({0, len(text), *(m.end() for m in _SENTENCE_END.finditer(text))})


def insert_needle(text: str, needle: str, position: int) -> str:
    """``needle`` at the boundary ``position`` of ``text``, separated from its neighbours by one space."""
    if position == 0:
        return f"{needle} {text}" if text else needle
    if position >= len(text):
        return f"{text} {needle}"
    return f"{text[:position]} {needle}{text[position:]}"


def build_prompt(tokenizer: Tokenizer, document: str) -> list[int]:
    """The chat prompt (with generation prompt) asking for the passphrase hidden in ``document``."""
    content = f"{INSTRUCTION}\n\n<text>\n{document}\n</text>\n\n{QUESTION}"
    return tokenizer.encode_chat([{"role": "user", "content": content}])


def load_haystack_tokens(tokenizer: Tokenizer, min_tokens: int, path: Path = AUSTEN) -> list[int]:
    """The first ``min_tokens`` (or a few more) tokens of the cleaned text at ``path``."""
    raw = require(path, "needle haystack text").read_text(encoding="utf-8", errors="replace")
    chars = max(min_tokens, 64) * 6  # English prose is about 4-5 characters per token
    while True:
        ids = tokenizer.encode(clean_text(raw[:chars]), add_special_tokens=False)
        if len(ids) >= min_tokens or chars >= len(raw):
            break
        chars *= 2
    if len(ids) < min_tokens:
        raise ValueError(f"{path} gives {len(ids)} tokens; the needle haystack needs {min_tokens}")
    return ids


def build_cells(
    tokenizer: Tokenizer, haystack_ids: Sequence[int], length: int, depths: Sequence[float], seed: int = NEEDLE_SEED
) -> list[NeedleCell]:
    """The prompts of one haystack length, one per depth, all at most ``length`` tokens, sharing one haystack."""
    needles = [NEEDLE_TEMPLATE.format(value=needle_value(seed, length, d)) for d in depths]
    overhead = max(len(build_prompt(tokenizer, needle)) for needle in needles)
    budget = min(length - overhead, len(haystack_ids))
    if budget < 1:
        raise ValueError(
            f"haystack length {length} leaves no room for text: the template, needle and question take {overhead} "
            "tokens"
        )
    for _ in range(8):
        cells = _cells_with_budget(tokenizer, haystack_ids[:budget], length, depths, needles, seed)
        excess = max(len(c.prompt_ids) for c in cells) - length
        if excess <= 0:
            return cells
        budget -= excess
        if budget < 1:
            break
    raise ValueError(f"could not fit a haystack into {length} prompt tokens")


def _cells_with_budget(
    tokenizer: Tokenizer,
    haystack_ids: Sequence[int],
    length: int,
    depths: Sequence[float],
    needles: Sequence[str],
    seed: int,
) -> list[NeedleCell]:
    text = tokenizer.decode(haystack_ids)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    boundaries = sentence_boundaries(text)
    cells = []
    for depth, needle in zip(depths, needles, strict=True):
        target = len(tokenizer.decode(haystack_ids[: round(depth * len(haystack_ids))]))
        position = min(boundaries, key=lambda b: (abs(b - target), b))
        before = len(tokenizer.encode(text[:position], add_special_tokens=False)) if position else 0
        prompt = build_prompt(tokenizer, insert_needle(text, needle, position))
        value = needle_value(seed, length, depth)
        cells.append(NeedleCell(length, depth, value, prompt, before / max(n, 1), n))
    return cells


def evaluate_needle(
    engine: LLMEngine,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    max_tokens: int = NEEDLE_MAX_TOKENS,
    seed: int = NEEDLE_SEED,
    text: Path = AUSTEN,
) -> dict:
    """Plant a needle in every (length, depth) cell, ask for it greedily, and score exact retrieval.

    Returns a JSON-serialisable dict: ``lengths``, ``depths``, ``scores`` ([depth][length]),
    ``cells`` (one record per prompt), ``mean_score``, ``seconds`` and the fixed design
    (``max_tokens``, ``seed``, ``needle``, ``question``).
    """
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling.sampling_params import SamplingParams

    lengths, depths = [int(n) for n in lengths], [float(d) for d in depths]
    if not lengths or not depths:
        raise ValueError("needle eval needs at least one length and one depth")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"needle depths are fractions within [0, 1], got {depths}")
    limit = engine.max_model_len - max_tokens
    too_long = [n for n in lengths if n > limit]
    if too_long:
        raise ValueError(
            f"haystack length(s) {', '.join(map(str, too_long))} do not fit: the context is {engine.max_model_len} "
            f"tokens and {max_tokens} are kept for the answer, so prompts can have at most {limit} tokens"
        )
    tokenizer = engine.tokenizer
    haystack = load_haystack_tokens(tokenizer, max(lengths), text)
    cells = [cell for length in lengths for cell in build_cells(tokenizer, haystack, length, depths, seed)]

    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = LLM.from_engine(engine).generate([c.prompt_ids for c in cells], params, use_tqdm=True)
    seconds = time.perf_counter() - start

    records = []
    for cell, output in zip(cells, outputs, strict=True):
        answer = output.outputs[0].text
        records.append({
            "length": cell.length,
            "depth": cell.depth,
            "actual_depth": round(cell.actual_depth, 4),
            "prompt_tokens": len(cell.prompt_ids),
            "haystack_tokens": cell.haystack_tokens,
            "needle": cell.value,
            "answer": answer,
            "score": score_answer(answer, cell.value),
        })  # fmt: skip
    by_cell = {(r["length"], r["depth"]): r["score"] for r in records}
    scores = [[by_cell[(length, depth)] for length in lengths] for depth in depths]
    return {
        "lengths": lengths,
        "depths": depths,
        "scores": scores,
        "cells": records,
        "mean_score": sum(r["score"] for r in records) / len(records),
        "seconds": seconds,
        "max_tokens": max_tokens,
        "seed": seed,
        "needle": NEEDLE_TEMPLATE,
        "question": QUESTION,
    }


def needle_headline(results: dict) -> str:
    lengths = results["lengths"]
    span = f"{min(lengths)}-{max(lengths)}" if len(set(lengths)) > 1 else f"{lengths[0]}"
    return f"needle retrieval {results['mean_score']:.3f} over {len(results['cells'])} cells (lengths {span} tokens)"


def draw_needle_heatmap(results: dict, path: Path, title: str = "") -> None:
    """Score per cell: x = haystack length (whole prompt, tokens), y = needle depth (0% on top), red 0 to green 1."""
    plt = pyplot("eval")

    lengths, depths, scores = results["lengths"], results["depths"], results["scores"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(lengths) + 2.5), max(3.0, 0.45 * len(depths) + 1.8)))
    image = ax.imshow(scores, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(scores):
        for j, score in enumerate(row):
            colour = "black" if 0.25 < score < 0.75 else "white"
            ax.text(j, i, f"{score:.2g}", ha="center", va="center", color=colour, fontsize=9)
    ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d * 100:.0f}%" for d in depths])
    ax.set_xlabel("haystack length (whole prompt, tokens)")
    ax.set_ylabel("needle depth")
    heading = f"Needle in a haystack: mean retrieval {results['mean_score']:.3f}"
    ax.set_title(f"{heading}\n{title}" if title else heading, fontsize=10)
    fig.colorbar(image, ax=ax, label="exact retrieval")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

"""Scoring functions, free of models: accuracies, their standard errors, perplexity and answer matching.

Conventions follow lm-evaluation-harness (``acc``, ``acc_norm``, ``mean_stderr``, LAMBADA's
perplexity) and SQuAD (answer normalisation, token F1), so numbers compare with published ones.
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.platform.extras import extra_imports


@dataclass(frozen=True)
class ChoiceScores:
    """One multiple-choice question: the log-likelihood of each choice and the right one."""

    logprobs: Sequence[float]  # sum of the continuation's token logprobs, per choice
    lengths: Sequence[int]  # characters of each choice, for the length-normalised accuracy
    gold: int


def choice_accuracy(question: ChoiceScores) -> tuple[float, float]:
    """(acc, acc_norm) of one question: 1.0 when the best-scoring choice is the gold one.

    ``acc_norm`` divides each log-likelihood by its choice's length in characters (lm-eval).
    Ties go to the first choice, as ``argmax`` does there.
    """
    if not 0 <= question.gold < len(question.logprobs):
        raise ValueError(f"gold choice {question.gold} is outside the {len(question.logprobs)} choices")
    acc = float(_argmax(question.logprobs) == question.gold)
    normalised = [lp / max(length, 1) for lp, length in zip(question.logprobs, question.lengths, strict=True)]
    return acc, float(_argmax(normalised) == question.gold)


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no values to average")
    return sum(values) / len(values)


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean with the sample standard deviation (n - 1), as lm-eval reports it."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = mean(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n)


def perplexity(total_logprob: float, count: int) -> float:
    """exp of the mean negative log-likelihood per unit (token, word, document)."""
    if count < 1:
        raise ValueError("perplexity needs at least one scored unit")
    return math.exp(-total_logprob / count)


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def contains_answer(prediction: str, reference: str) -> float:
    """1.0 when the normalised reference appears in the normalised prediction (a chatty answer still counts)."""
    reference = normalize_answer(reference)
    return float(bool(reference) and f" {reference} " in f" {normalize_answer(prediction)} ")


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 between normalised texts."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


_OPTION = re.compile(r"\(?\b([A-D])\b\)?")


def option_letter(text: str) -> str | None:
    """The first option letter A-D a model's answer names ("(B) ...", "B.", "Answer: C"), else None."""
    match = re.search(r"\(([A-D])\)", text) or _OPTION.search(text)
    return match.group(1) if match else None


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure with stemming (Google's ``rouge-score``, the reference implementation)."""
    return _rouge_scorer().score(reference, prediction)["rougeL"].fmeasure


@functools.cache  # building the stemmer's scorer is slow; one per process
def _rouge_scorer():  # noqa: ANN202 - rouge_score.rouge_scorer.RougeScorer
    with extra_imports("eval", "ROUGE-L (the meeting and gov_report evaluations)"):
        from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))

"""Zero-shot multiple choice from log-likelihoods (PIQA, COPA, WinoGrande, ARC-Easy) and LAMBADA.

Prompts follow lm-evaluation-harness: PIQA and ARC as ``Question: ...\\nAnswer:`` with each choice
after a space, COPA as the premise with its connective, WinoGrande by partial scoring (the same
continuation after each option-filled context), LAMBADA as the passage and its last word.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.eval.data import MULTIPLE_CHOICE, require
from kvserve.eval.loglikelihood import LoglikelihoodRequest, Scorer
from kvserve.eval.metrics import ChoiceScores, choice_accuracy, mean, mean_stderr, perplexity
from kvserve.text.tokenizer import Tokenizer

CHOICE_TASKS = ("piqa", "copa", "winogrande", "arc_easy")
TASKS = (*CHOICE_TASKS, "lambada")
_FILES = {"lambada": "lambada_openai.jsonl"}


@dataclass(frozen=True)
class Question:
    contexts: tuple[str, ...]  # one per choice (WinoGrande's differ; elsewhere all the same)
    continuations: tuple[str, ...]  # one per choice; LAMBADA has a single one
    gold: int
    choice_lengths: tuple[int, ...]  # characters of each choice, for acc_norm


def load_questions(task: str, limit: int | None = None, data_dir: Path = MULTIPLE_CHOICE) -> list[Question]:
    if task not in TASKS:
        raise ValueError(f"unknown multiple-choice task {task!r}; expected one of {', '.join(TASKS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    path = require(data_dir / _FILES.get(task, f"{task}.jsonl"), f"{task} data")
    questions = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(questions) >= limit:
                break
            questions.append(_question(task, json.loads(line)))
    return questions


def _question(task: str, doc: dict) -> Question:
    if task == "lambada":
        return Question((doc["context"],), (" " + doc["continuation"],), 0, (len(doc["continuation"]),))
    if task == "winogrande":
        options = tuple(doc["context_options"])
        return Question(options, (" " + doc["continuation"],) * len(options), doc["gold"], (1,) * len(options))
    choices = doc["choices"]
    context = doc["query"]
    if task in ("piqa", "arc_easy"):
        context = context.rstrip("\n") + "\nAnswer:"
    return Question(
        (context,) * len(choices), tuple(" " + c for c in choices), doc["gold"], tuple(len(c) for c in choices)
    )


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> LoglikelihoodRequest:
    """lm-eval's split: trailing spaces move to the continuation, the continuation's tokens are what
    follows the context's tokens in the tokenisation of the whole text."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return LoglikelihoodRequest(tuple(context_ids), tuple(whole[len(context_ids) :]))


def evaluate_multiple_choice(
    scorer: Scorer, tokenizer: Tokenizer, task: str, questions: Sequence[Question]
) -> dict[str, object]:
    """Accuracy (and LAMBADA's perplexity) with lm-eval's standard errors; per-question correctness kept
    so two runs can be compared question by question."""
    requests = [
        encode_pair(tokenizer, context, continuation)
        for q in questions
        for context, continuation in zip(q.contexts, q.continuations, strict=True)
    ]
    scores = iter(scorer.loglikelihood(requests))
    if task == "lambada":
        results = [next(scores) for _ in questions]
        correct = [float(r.is_greedy) for r in results]
        return {
            "task": task,
            "num_questions": len(questions),
            "acc": mean(correct),
            "acc_stderr": mean_stderr(correct),
            "perplexity": perplexity(sum(r.logprob for r in results), len(results)),
            "correct": [int(c) for c in correct],
        }
    accs, norms = [], []
    for q in questions:
        logprobs = [next(scores).logprob for _ in q.continuations]
        acc, acc_norm = choice_accuracy(ChoiceScores(logprobs, q.choice_lengths, q.gold))
        accs.append(acc)
        norms.append(acc_norm)
    return {
        "task": task,
        "num_questions": len(questions),
        "acc": mean(accs),
        "acc_stderr": mean_stderr(accs),
        "acc_norm": mean(norms),
        "acc_norm_stderr": mean_stderr(norms),
        "correct": [int(a) for a in accs],
    }

"""L-Eval long-document tasks through the engine: QuALITY, Natural Questions, topic retrieval, meeting
and government-report summaries (An et al., "L-Eval", ACL 2024).

Conventions follow L-Eval's own baselines (``Baselines/*-test.py`` and ``LEval_config.py``):

- Prompts use L-Eval's system instruction for the task's metric, the document, then the question.
  For the n-gram tasks (token F1, ROUGE-L) the instruction ends with L-Eval's length hint, "The
  suggested output length is around N words", N being the gold answer's word count (its
  length-instruction-enhanced evaluation), so scores compare with the published ones.
- A document that does not fit is truncated keeping its beginning, as the baselines do (and topic
  retrieval asks about the first topics). The cut is measured in tokens so that every chat prompt of
  the document (template + instruction + document + question) is at most ``context`` tokens; all
  questions of a document see the same truncated text.
- Answers are greedy. Scoring: ``quality`` compares the first option letter the answer names with
  the gold's (no letter counts wrong); ``topic_retrieval`` counts an answer containing the gold topic
  (SQuAD-normalised) and also reports exact match; ``natural_question`` uses SQuAD token F1 and exact
  match; ``meeting`` and ``gov_report`` use ROUGE-L F with stemming. Standard errors as lm-eval's.

Prompt format: one user message in the model's chat template (its own system prompt, if it has one,
stays). The document comes before the question, so the questions of one document share a token
prefix and the engine's automatic prefix cache computes the document's KV once::

    quality:          {EXAM_INSTRUCTION}\\n\\nDocument is as follows. {document}\\n\\nQuestion: {question}
                      \\nPlease directly give the answer without any additional output or explanation.
    topic_retrieval:  {TOPIC_INSTRUCTION}\\n\\n{document}\\n\\n{question}
    natural_question, meeting, gov_report:
                      {NGRAM_INSTRUCTION}\\n\\nDocument is as follows. {document}\\n\\nInstruction: {question}
                      The suggested output length is around {N} words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.eval.data import LEVAL, require
from kvserve.eval.metrics import contains_answer, exact_match, mean, mean_stderr, option_letter, rouge_l, token_f1
from kvserve.log import get_logger

if TYPE_CHECKING:
    from kvserve.core.engine import LLMEngine
    from kvserve.core.outputs import RequestOutput
    from kvserve.sampling.sampling_params import SamplingParams
    from kvserve.text.tokenizer import Tokenizer

LONGQA_TASKS = ("quality", "natural_question", "topic_retrieval", "meeting", "gov_report")

_FILES = {
    "quality": "quality.jsonl",
    "natural_question": "natural_question.jsonl",
    "topic_retrieval": "topic_retrieval_longchat.jsonl",
    "meeting": "meeting_summ.jsonl",
    "gov_report": "gov_report_summ.jsonl",
}

# Tokens generated per answer, from the gold answers' lengths in SmolLM2's tokens (median / max):
# quality 16 / 46, but only the option letter is scored and it comes first, 16 leaves room for "The
# answer is (B)"; topic names 6 / 10, 32 allows a short preamble; Natural Questions 4 / 72 with 90%
# under 12, so 32 cuts only the rare list answers; meeting summaries 66 / 141, 256 never cuts them;
# government-report summaries 335 / 557, so 512 (256 would cut nearly every summary and cap ROUGE-L).
DEFAULT_MAX_TOKENS = {"quality": 16, "topic_retrieval": 32, "natural_question": 32, "meeting": 256, "gov_report": 512}

# The headline metric of each task: (key in the per-question records, words for the headline).
HEADLINE_METRIC = {
    "quality": ("option_acc", "option accuracy"),
    "topic_retrieval": ("contains", "topic accuracy"),
    "natural_question": ("f1", "token F1"),
    "meeting": ("rouge_l", "ROUGE-L"),
    "gov_report": ("rouge_l", "ROUGE-L"),
}

# L-Eval's system instructions (LEval_config.get_sys_prompt), by metric family.
EXAM_INSTRUCTION = (
    "Now you are given a very long document. Please follow the instruction based on this document. For "
    "multi-choice questions, there could be only one correct option. Please only answer the letter (A, B, C, D) "
    "and don't give any explanation."
)
TOPIC_INSTRUCTION = (
    "Below is a record of our previous conversation on many different topics. You are the ASSISTANT, and I am "
    "the USER. At the beginning of each topic, the USER will say 'I would like to discuss the topic of <TOPIC>'. "
    "Memorize each <TOPIC>. At the end of the record, I will ask you to retrieve the first/second/third topic "
    "names. Now the record start."
)
NGRAM_INSTRUCTION = (
    "Now you are given a very long document. Please follow the instruction after this document. These "
    "instructions may include summarizing a document, answering questions based on the document, or writing a "
    "required paragraph."
)


@dataclass(frozen=True)
class Document:
    """One L-Eval record: a long input and its questions with their gold answers, in file order."""

    text: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]


@dataclass(frozen=True)
class DocumentPrompts:
    """The chat prompts (token ids) of one document's questions, and how much of the document they keep."""

    prompts: list[list[int]]
    document_tokens: int
    kept_tokens: int

    @property
    def truncated(self) -> bool:
        return self.kept_tokens < self.document_tokens

    @property
    def fraction_kept(self) -> float:
        return self.kept_tokens / self.document_tokens if self.document_tokens else 1.0


def load_documents(task: str, limit: int | None = None, data_dir: Path = LEVAL) -> list[Document]:
    """The task's documents in file order; ``limit``: the first N only."""
    _check_task(task)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    path = require(data_dir / _FILES[task], f"L-Eval {task} data")
    documents = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(documents) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            questions, answers = tuple(row["instructions"]), tuple(row["outputs"])
            if len(questions) != len(answers):
                raise ValueError(f"{path}:{number}: {len(questions)} instructions but {len(answers)} outputs")
            documents.append(Document(row["input"], questions, answers))
    return documents


def user_message(task: str, document: str, question: str, gold: str) -> str:
    """The user turn for one question (see the module docstring); ``gold`` only gives the length hint."""
    if task == "quality":
        return (
            f"{EXAM_INSTRUCTION}\n\nDocument is as follows. {document}\n\nQuestion: {question}\n"
            "Please directly give the answer without any additional output or explanation."
        )
    if task == "topic_retrieval":
        return f"{TOPIC_INSTRUCTION}\n\n{document}\n\n{question}"
    _check_task(task)
    return (
        f"{NGRAM_INSTRUCTION}\n\nDocument is as follows. {document}\n\nInstruction: {question}\n"
        f"The suggested output length is around {len(gold.split())} words."
    )


def build_prompts(tokenizer: Tokenizer, task: str, document: Document, context: int) -> DocumentPrompts:
    """Chat prompts for every question of ``document``, each at most ``context`` tokens.

    The document keeps its first ``kept_tokens`` tokens, as many as let its longest prompt fit. The
    text is cut at a token boundary and re-encoded inside the prompt, which can merge tokens
    differently at the seams, so the cut is checked on the real prompts: moved back until they fit,
    then forward once into any room left. The longest prompt ends up within a token or two of
    ``context`` (one more document token can cost two prompt tokens), never over it.
    """
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    doc_ids = tokenizer.encode(document.text, add_special_tokens=False)

    def encode_all(text: str) -> list[list[int]]:
        return [
            tokenizer.encode_chat([{"role": "user", "content": user_message(task, text, question, gold)}])
            for question, gold in zip(document.questions, document.answers, strict=True)
        ]

    # First guess from the prompts around an empty document: saves encoding a 40k-token text per question.
    overhead = max(map(len, encode_all("")), default=0)
    if overhead >= context:
        raise ValueError(
            f"context={context} tokens cannot hold even the template and question of a prompt ({overhead} tokens "
            "with an empty document); raise --context"
        )

    def fit(keep: int) -> tuple[list[list[int]], int]:
        text = document.text if keep == len(doc_ids) else tokenizer.decode(doc_ids[:keep])
        prompts = encode_all(text)
        return prompts, context - max(map(len, prompts), default=0)  # room left in the longest prompt

    keep = min(len(doc_ids), context - overhead)
    prompts, room = fit(keep)
    while room < 0:  # the seams merged fewer tokens than the guess assumed: cut further
        if keep == 0:  # cannot happen once the empty-document prompts fit; a guard against looping
            raise ValueError(f"context={context} tokens cannot hold the prompt even without the document")
        keep = max(keep + room, 0)
        prompts, room = fit(keep)
    if room > 0 and keep < len(doc_ids):  # the guess was pessimistic (a space merged into the seam): fill the room
        grown = min(len(doc_ids), keep + room)
        grown_prompts, grown_room = fit(grown)
        if grown_room >= 0:
            keep, prompts = grown, grown_prompts
    return DocumentPrompts(prompts, len(doc_ids), keep)


def pml_prompts(
    tokenizer: Tokenizer, task: str, document: Document, kept_text: str, name: str
) -> tuple[str, list[str]]:
    """Prompt Cache form of a document's chat prompts: a schema whose module is the document (the chat
    template and instruction before it are the schema's own text) and one PML prompt per question, whose
    new text is everything after the document. Text is kept exactly (``xml:space="preserve"``)."""
    from kvserve.prompt_cache.pml import pml_escape
    from kvserve.prompt_cache.roles import RoleFrames

    sentinel = "\x00DOCUMENT\x00"
    heads, prompts = set(), []
    for question, gold in zip(document.questions, document.answers, strict=True):
        message = user_message(task, sentinel, question, gold)
        head, _, tail = tokenizer.apply_chat_template([{"role": "user", "content": message}]).partition(sentinel)
        heads.add(head)
        prompts.append(f'<prompt schema="{name}" xml:space="preserve"><doc/>{pml_escape(tail)}</prompt>')
    (head,) = heads  # the document comes first in every question's prompt
    frames = RoleFrames.from_tokenizer(tokenizer)
    if frames is not None and frames.opening and head.startswith(frames.opening):
        head = head[len(frames.opening) :]  # a schema opens the sequence itself (its BOS): not twice
    doc = f'<module name="doc">{pml_escape(kept_text)}</module>'
    return f'<schema name="{name}" xml:space="preserve">{pml_escape(head)}{doc}</schema>', prompts


def score_answer(task: str, prediction: str, gold: str) -> dict[str, float]:
    """Every metric of one answer; the task's headline metric (``HEADLINE_METRIC``) is among them."""
    if task == "quality":
        gold_letter = option_letter(gold)
        if gold_letter is None:
            raise ValueError(f"quality gold answer {gold[:60]!r} names no option letter")
        return {"option_acc": float(option_letter(prediction) == gold_letter)}
    if task == "topic_retrieval":
        return {"contains": contains_answer(prediction, gold), "exact_match": exact_match(prediction, gold)}
    if task == "natural_question":
        return {"f1": token_f1(prediction, gold), "exact_match": exact_match(prediction, gold)}
    _check_task(task)
    return {"rouge_l": rouge_l(prediction, gold)}


def score_predictions(task: str, documents: Sequence[Document], predictions: Sequence[str]) -> dict[str, object]:
    """Per-question records and the mean and standard error of each metric. ``predictions`` are in
    question order: all of document 0's questions, then document 1's, ..."""
    golds = [(d, i, gold) for d, doc in enumerate(documents) for i, gold in enumerate(doc.answers)]
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} questions")
    if not golds:
        raise ValueError("no questions to score")
    key = HEADLINE_METRIC[task][0]
    scores = [score_answer(task, prediction, gold) for (_, _, gold), prediction in zip(golds, predictions, strict=True)]
    records = []
    for number, ((d, i, gold), prediction, score) in enumerate(zip(golds, predictions, scores, strict=True)):
        record = {"question": number, "document": d, "index": i, "prediction": prediction, "gold": gold}
        record |= {"score": score[key]} | {name: value for name, value in score.items() if name != key}
        if task == "quality":
            record["letter"], record["gold_letter"] = option_letter(prediction), option_letter(gold)
        records.append(record)
    metrics = {
        name: {"mean": mean([s[name] for s in scores]), "stderr": mean_stderr([s[name] for s in scores])}
        for name in scores[0]
    }
    return {"metrics": metrics, "records": records}


def evaluate_longqa(
    engine: LLMEngine,
    task: str,
    context: int | None = None,
    max_tokens: int | None = None,
    limit: int | None = None,
    data_dir: Path = LEVAL,
    prompt_cache: bool = False,
) -> dict[str, object]:
    """Greedy answers to every question of the task's (first ``limit``) documents, scored.

    ``context``: prompt tokens at most (default: the engine's ``max_model_len`` less ``max_tokens``);
    ``max_tokens``: tokens generated per answer (default: ``DEFAULT_MAX_TOKENS[task]``).
    ``prompt_cache``: each (truncated) document is a Prompt Cache module encoded on its own (it does
    not attend to the instruction before it) and each question a PML prompt importing it, one document
    at a time (``pml_prompts``); otherwise the plain chat prompts.
    Returns a JSON-serialisable dict; ``questions`` holds one record per question, in question order.
    """
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling.sampling_params import SamplingParams

    _check_task(task)
    max_tokens = DEFAULT_MAX_TOKENS[task] if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    context = engine.max_model_len - max_tokens if context is None else context
    if context < 1 or context + max_tokens > engine.max_model_len:
        raise ValueError(
            f"context={context} prompt tokens plus max_tokens={max_tokens} must fit in the model's context of "
            f"{engine.max_model_len} tokens, with context >= 1"
        )
    documents = load_documents(task, limit, data_dir)
    built = [build_prompts(engine.tokenizer, task, document, context) for document in documents]
    prompts = [prompt for doc in built for prompt in doc.prompts]

    # One call for all documents: the engine queues them in order, and a document's later questions find
    # its first question's full KV blocks in the prefix cache as soon as that question's prefill is scheduled.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    if prompt_cache:
        outputs = _generate_with_prompt_cache(engine, task, documents, built, params)
    else:
        outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start

    completions = [output.outputs[0] for output in outputs]
    scored = score_predictions(task, documents, [c.text for c in completions])
    records = scored["records"]
    for record, output, completion in zip(records, outputs, completions, strict=True):
        record["prompt_tokens"] = len(output.prompt_token_ids)
        record["generated_tokens"] = len(completion.token_ids)
        record["finish_reason"] = completion.finish_reason

    key, words = HEADLINE_METRIC[task]
    headline = scored["metrics"][key]
    truncated = sum(doc.truncated for doc in built)
    return {
        "task": task,
        "prompt_cache": prompt_cache,
        "data": str(data_dir / _FILES[task]),
        "metric": key,
        "metric_name": words,
        "score": headline["mean"],
        "score_stderr": headline["stderr"],
        "metrics": scored["metrics"],
        "num_documents": len(documents),
        "num_questions": len(records),
        "context": context,
        "max_tokens": max_tokens,
        "truncation": {
            "context": context,
            "documents_truncated": truncated,
            "mean_fraction_kept": mean([doc.fraction_kept for doc in built]),
            "document_tokens": sum(doc.document_tokens for doc in built),
            "kept_tokens": sum(doc.kept_tokens for doc in built),
        },
        "documents": [
            {"document_tokens": doc.document_tokens, "kept_tokens": doc.kept_tokens, "questions": len(doc.prompts)}
            for doc in built
        ],
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_prompt_tokens": sum(output.num_cached_tokens for output in outputs),
        "generated_tokens": sum(len(c.token_ids) for c in completions),
        "seconds": seconds,
        "questions": records,
    }


def _generate_with_prompt_cache(
    engine: LLMEngine, task: str, documents: Sequence[Document], built: Sequence[DocumentPrompts],
    params: SamplingParams,
) -> list[RequestOutput]:  # fmt: skip
    """Per document: register its schema (encoding the document once), answer its questions, remove it."""
    from kvserve.entrypoints.llm import LLM

    llm, outputs = LLM.from_engine(engine), []
    for number, (document, prompts) in enumerate(zip(documents, built, strict=True)):
        kept = document.text if not prompts.truncated else engine.tokenizer.decode(
            engine.tokenizer.encode(document.text, add_special_tokens=False)[: prompts.kept_tokens]
        )  # fmt: skip
        name = f"leval-{task}-{number}"
        schema, pml = pml_prompts(engine.tokenizer, task, document, kept, name)
        start = time.perf_counter()
        engine.register_schema(schema)
        try:
            outputs += llm.generate(pml, params, use_tqdm=False)
        finally:
            engine.prompt_cache.remove(name)
        get_logger().info(
            "document %d/%d: %d tokens as a module, %d questions (%.1f s)",
            number + 1, len(documents), prompts.kept_tokens, len(pml), time.perf_counter() - start,
        )  # fmt: skip
    return outputs


def longqa_headline(results: dict) -> str:
    """E.g. "quality option accuracy 0.2970 ± 0.0322 over 202 questions (15 documents, 12 truncated)"."""
    return (
        f"{results['task']} {results['metric_name']} {results['score']:.4f} ± {results['score_stderr']:.4f} over "
        f"{results['num_questions']:,} questions ({results['num_documents']:,} documents, "
        f"{results['truncation']['documents_truncated']:,} truncated)"
    )


def _check_task(task: str) -> None:
    if task not in LONGQA_TASKS:
        raise ValueError(f"unknown L-Eval task {task!r}; expected one of {', '.join(LONGQA_TASKS)}")

"""L-Eval long-document QA: data loading, prompts and head-keeping truncation in tokens (with the real
default tokenizer), scoring of known answers for every task kind, argument checks, and one short
QuALITY run through the engine on the real default model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from kvserve.eval.data import LEVAL
from kvserve.eval.longqa import (
    DEFAULT_MAX_TOKENS,
    EXAM_INSTRUCTION,
    LONGQA_TASKS,
    TOPIC_INSTRUCTION,
    Document,
    build_prompts,
    evaluate_longqa,
    load_documents,
    longqa_headline,
    pml_prompts,
    score_answer,
    score_predictions,
    user_message,
)

# ~4,700 tokens: each sentence names its number, so the kept head is easy to check.
LONG_TEXT = " ".join(f"Sentence number {i} says the colour is blue." for i in range(400))
LONG = Document(LONG_TEXT, ("What colour?", "Which number comes first? Answer with a number."), ("blue", "0"))
SHORT = Document("The sky was green that day.", ("What colour was the sky?",), ("green",))


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


def chat(tokenizer, task: str, text: str, question: str, gold: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": user_message(task, text, question, gold)}])


# ----- data and arguments -----


def test_load_documents_keeps_file_order_and_limit():
    first_line = json.loads((LEVAL / "quality.jsonl").open().readline())
    documents = load_documents("quality", limit=2)
    assert len(documents) == 2
    assert documents[0].text == first_line["input"]
    assert documents[0].questions == tuple(first_line["instructions"])
    assert documents[0].answers == tuple(first_line["outputs"])
    # Without a limit, every record of the file: tests/data holds 3 QuALITY stories and 2 government reports.
    assert len(load_documents("quality")) == 3 and len(load_documents("gov_report")) == 2


def test_bad_limit_task_and_sizes_are_errors_naming_the_value():
    engine = SimpleNamespace(tokenizer=None, max_model_len=1024)  # every check runs before any model work
    with pytest.raises(ValueError, match="--limit must be >= 1, got 0"):
        evaluate_longqa(engine, "quality", limit=0)
    with pytest.raises(ValueError, match="got -3"):
        load_documents("meeting", limit=-3)
    with pytest.raises(ValueError, match="unknown L-Eval task 'squad'"):
        evaluate_longqa(engine, "squad")
    with pytest.raises(ValueError, match="--max-tokens must be >= 1, got 0"):
        evaluate_longqa(engine, "quality", max_tokens=0)
    with pytest.raises(ValueError, match="context=1020 prompt tokens plus max_tokens=16 .* 1024 tokens"):
        evaluate_longqa(engine, "quality", context=1020)
    with pytest.raises(ValueError, match="context=0"):
        evaluate_longqa(engine, "quality", context=0)


def test_default_max_tokens_leave_the_rest_of_the_model_context_to_the_prompt():
    assert set(DEFAULT_MAX_TOKENS) == set(LONGQA_TASKS)
    engine = SimpleNamespace(tokenizer=None, max_model_len=DEFAULT_MAX_TOKENS["gov_report"])  # no room: 0 tokens
    with pytest.raises(ValueError, match="context=0 prompt tokens plus max_tokens=512"):
        evaluate_longqa(engine, "gov_report")


# ----- prompts and truncation -----


def test_prompt_format_puts_instruction_document_question_in_that_order():
    exam = user_message("quality", "DOC", "Q? (A) x (B) y", "(B) y")
    assert exam.startswith(EXAM_INSTRUCTION + "\n\nDocument is as follows. DOC\n\nQuestion: Q? (A) x (B) y\n")
    topic = user_message("topic_retrieval", "DOC", "First topic?", "Art")
    assert topic == f"{TOPIC_INSTRUCTION}\n\nDOC\n\nFirst topic?"
    for task in ("natural_question", "meeting", "gov_report"):
        message = user_message(task, "DOC", "Summarise.", "three gold words")
        assert message.index("DOC") < message.index("Instruction: Summarise.")
        assert message.endswith("The suggested output length is around 3 words.")  # L-Eval's length hint


@pytest.mark.parametrize("task", LONGQA_TASKS)
def test_short_document_is_kept_whole(tokenizer, task):
    built = build_prompts(tokenizer, task, SHORT, context=500)
    assert not built.truncated and built.fraction_kept == 1.0
    assert built.kept_tokens == built.document_tokens == len(tokenizer.encode(SHORT.text, add_special_tokens=False))
    assert built.prompts == [chat(tokenizer, task, SHORT.text, SHORT.questions[0], SHORT.answers[0])]


@pytest.mark.parametrize("task", LONGQA_TASKS)
@pytest.mark.parametrize("context", [200, 301, 777])
def test_long_document_is_cut_to_fit_the_context_keeping_its_head(tokenizer, task, context):
    built = build_prompts(tokenizer, task, LONG, context)
    longest = max(map(len, built.prompts))
    assert context - 2 <= longest <= context  # within the limit, wasting at most the seam's two tokens
    assert built.truncated and 0 < built.kept_tokens < built.document_tokens
    assert built.fraction_kept == built.kept_tokens / built.document_tokens
    head = tokenizer.decode(tokenizer.encode(LONG_TEXT, add_special_tokens=False)[: built.kept_tokens])
    assert LONG_TEXT.startswith(head) and head.startswith("Sentence number 0 says")
    for prompt, question, gold in zip(built.prompts, LONG.questions, LONG.answers, strict=True):
        assert prompt == chat(tokenizer, task, head, question, gold)  # the whole prompt, template and all


def test_questions_of_a_document_share_its_tokens_as_a_prefix(tokenizer):
    first, second = build_prompts(tokenizer, "natural_question", LONG, 600).prompts
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 600 - 40  # everything up to the question's own words: the prefix cache reuses it


def test_context_that_cannot_hold_the_question_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="context=50 tokens cannot hold even the template"):
        build_prompts(tokenizer, "quality", LONG, 50)


# ----- scoring -----


@pytest.mark.parametrize(
    ("task", "prediction", "gold", "expected"),
    [
        ("quality", "(B)", "(B) Their subconscious knew", {"option_acc": 1.0}),
        ("quality", "The answer is (B) their subconscious.", "(B) Their subconscious knew", {"option_acc": 1.0}),
        ("quality", "C", "(B) Their subconscious knew", {"option_acc": 0.0}),
        ("quality", "I cannot tell.", "(B) Their subconscious knew", {"option_acc": 0.0}),  # no letter: wrong
        ("topic_retrieval", "The role of art in society", "The role of art in society",
         {"contains": 1.0, "exact_match": 1.0}),
        ("topic_retrieval", "The first topic was the role of art in society.", "The role of art in society",
         {"contains": 1.0, "exact_match": 0.0}),
        ("topic_retrieval", "Climate change", "The role of art in society", {"contains": 0.0, "exact_match": 0.0}),
        ("natural_question", "April 25, 2018", "April 25 , 2018", {"f1": 1.0, "exact_match": 1.0}),
        ("natural_question", "25 April", "April 25 , 2018", {"f1": 0.8, "exact_match": 0.0}),
        ("natural_question", "Stephen Curry", "13", {"f1": 0.0, "exact_match": 0.0}),
        ("meeting", "the team agreed to mark overlaps", "the team agreed to mark overlaps", {"rouge_l": 1.0}),
        ("gov_report", "budget cuts", "presidential emergency powers", {"rouge_l": 0.0}),
        # LCS "the president ... powers" = 3 of 4 and 3 of 5 words: F = 2 * 3/4 * 3/5 / (3/4 + 3/5) = 2/3
        ("gov_report", "the president holds powers", "the president has emergency powers", {"rouge_l": 2 / 3}),
    ],
)  # fmt: skip
def test_score_answer_gives_the_known_scores(task, prediction, gold, expected):
    scores = score_answer(task, prediction, gold)
    assert scores.keys() == expected.keys()
    for name, value in expected.items():
        assert scores[name] == pytest.approx(value)


def test_score_predictions_keeps_question_order_and_averages():
    documents = [
        Document("d0", ("q0", "q1"), ("(A) x", "(C) y")),
        Document("d1", ("q2",), ("(D) z",)),
    ]
    scored = score_predictions("quality", documents, ["(A)", "B", "The answer is D."])
    records = scored["records"]
    assert [(r["question"], r["document"], r["index"]) for r in records] == [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
    assert [r["score"] for r in records] == [1.0, 0.0, 1.0]
    assert [(r["letter"], r["gold_letter"]) for r in records] == [("A", "A"), ("B", "C"), ("D", "D")]
    assert [r["prediction"] for r in records] == ["(A)", "B", "The answer is D."]
    acc = scored["metrics"]["option_acc"]
    assert acc["mean"] == pytest.approx(2 / 3)
    assert acc["stderr"] == pytest.approx(math.sqrt(1 / 3 / 3))  # sample variance 1/3, n = 3
    with pytest.raises(ValueError, match="2 predictions for 3 questions"):
        score_predictions("quality", documents, ["A", "B"])

    topics = score_predictions("topic_retrieval", documents[1:], ["I think it was Z"])
    assert topics["records"][0]["score"] == 0.0 and "exact_match" in topics["records"][0]
    assert set(topics["metrics"]) == {"contains", "exact_match"}


def test_headline_names_metric_spread_and_truncation():
    results = {
        "task": "quality", "metric_name": "option accuracy", "score": 0.29703, "score_stderr": 0.03218,
        "num_questions": 202, "num_documents": 15, "truncation": {"documents_truncated": 12},
    }  # fmt: skip
    assert longqa_headline(results) == (
        "quality option accuracy 0.2970 ± 0.0322 over 202 questions (15 documents, 12 truncated)"
    )


# ----- the real model -----


@pytest.mark.real_model
def test_quality_on_the_default_model_runs_every_question_within_the_context(default_model):
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_memory="64MiB", swap_space=0), default_model)
    results = evaluate_longqa(engine, "quality", context=768, max_tokens=8, limit=1)
    json.dumps(results)  # the report is plain JSON

    (document,) = load_documents("quality", limit=1)
    records = results["questions"]
    assert results["num_documents"] == 1
    assert results["num_questions"] == len(records) == len(document.questions)
    assert [r["question"] for r in records] == list(range(len(records)))
    assert [r["gold"] for r in records] == list(document.answers)
    assert all(r["score"] in (0.0, 1.0) and r["prompt_tokens"] <= 768 for r in records)
    assert all(1 <= r["generated_tokens"] <= 8 for r in records)
    assert 0.0 <= results["score"] <= 1.0 and results["metric"] == "option_acc"
    assert results["score"] == pytest.approx(sum(r["score"] for r in records) / len(records))
    assert results["context"] == results["truncation"]["context"] == 768 and results["max_tokens"] == 8
    truncation = results["truncation"]
    assert truncation["documents_truncated"] == 1 and 0.0 < truncation["mean_fraction_kept"] < 1.0
    assert truncation["kept_tokens"] < truncation["document_tokens"]
    assert results["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert results["generated_tokens"] == sum(r["generated_tokens"] for r in records) and results["seconds"] > 0
    # The later questions found the document's KV in the prefix cache.
    assert results["cached_prompt_tokens"] >= (len(records) - 1) * truncation["kept_tokens"] * 0.9
    assert longqa_headline(results).startswith(f"quality option accuracy {results['score']:.4f}")


def test_pml_prompts_spell_out_the_plain_chat_prompt(tokenizer):
    from kvserve.prompt_cache.pml import Import, Module, Text, parse_prompt, parse_schema

    document = Document("A <b> & 'c'\r\nline two.", ("Which letter?", "Why?"), ("(B) b", "(A) a"))
    schema_text, prompts = pml_prompts(tokenizer, "quality", document, document.text, "doc-0")
    schema = parse_schema(schema_text)
    head, module = schema.children
    assert isinstance(head, Text) and module == Module("doc", (Text(document.text),))
    for pml, question, gold in zip(prompts, document.questions, document.answers, strict=True):
        prompt = parse_prompt(pml)
        imported, tail = prompt.children
        assert imported == Import("doc") and isinstance(tail, Text)
        plain = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message("quality", document.text, question, gold)}]
        )
        assert head.text + document.text + tail.text == plain


@pytest.mark.real_model
def test_quality_with_prompt_cache_encodes_each_document_once(default_model):
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_memory="64MiB", swap_space=0), default_model)
    results = evaluate_longqa(engine, "quality", context=768, max_tokens=8, limit=1, prompt_cache=True)
    records = results["questions"]
    assert results["prompt_cache"] and len(records) == len(load_documents("quality", limit=1)[0].questions)
    assert all(r["score"] in (0.0, 1.0) and 1 <= r["generated_tokens"] <= 8 for r in records)
    assert engine.prompt_cache.store.stats.encoded_modules == 2  # the instruction and the document, once
    assert not engine.prompt_cache.names() and engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert results["cached_prompt_tokens"] >= len(records) * results["truncation"]["kept_tokens"] * 0.9

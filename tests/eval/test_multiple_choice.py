"""Multiple-choice prompts in lm-eval's formats, and accuracies from known log-likelihoods."""

from __future__ import annotations

import math

import pytest

from kvserve.eval.loglikelihood import Loglikelihood
from kvserve.eval.multiple_choice import Question, encode_pair, evaluate_multiple_choice, load_questions


def test_prompts_follow_lm_eval():
    piqa = load_questions("piqa", limit=1)[0]
    assert piqa.contexts[0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.continuations[0].startswith(" Provide the guinea pig") and len(piqa.continuations) == 2
    assert piqa.choice_lengths[0] == len(piqa.continuations[0]) - 1  # the leading space is not counted
    copa = load_questions("copa", limit=1)[0]
    assert copa.contexts == ("The man turned on the faucet, therefore",) * 2
    assert copa.continuations == (" the toilet filled with water.", " water flowed from the spout.") and copa.gold == 1
    wino = load_questions("winogrande", limit=1)[0]
    assert wino.contexts[1].endswith("so Maria") and wino.continuations == (" always got the easier cases.",) * 2
    arc = load_questions("arc_easy", limit=1)[0]
    assert arc.contexts[0].endswith("food webs?\nAnswer:") and len(arc.continuations) == 4
    lambada = load_questions("lambada", limit=1)[0]
    assert lambada.continuations == (" signs",) and lambada.contexts[0].endswith("I don't care about")


def test_limit_and_unknown_task():
    assert len(load_questions("copa", limit=7)) == 7
    assert len(load_questions("copa")) == 100
    with pytest.raises(ValueError, match="unknown multiple-choice task 'hellaswag'"):
        load_questions("hellaswag")
    with pytest.raises(ValueError, match="--limit must be >= 1, got 0"):
        load_questions("copa", limit=0)


@pytest.mark.real_model
def test_encode_pair_splits_like_lm_eval(default_model):
    tokenizer = default_model.tokenizer
    request = encode_pair(tokenizer, "Question: dresser\nAnswer:", " finish, woodgrain")
    assert list(request.context) == tokenizer.encode("Question: dresser\nAnswer:", add_special_tokens=False)
    whole = tokenizer.encode("Question: dresser\nAnswer: finish, woodgrain", add_special_tokens=False)
    assert list(request.context + request.continuation) == whole
    # A trailing space moves to the continuation, so " finish" stays one word-initial token.
    assert encode_pair(tokenizer, "Question: dresser\nAnswer: ", "finish, woodgrain") == request


class TableScorer:
    """Log-likelihoods looked up by continuation text length, to make the winner known in advance."""

    name = "fake"

    def __init__(self, table: dict[int, Loglikelihood]) -> None:
        self.table = table

    def loglikelihood(self, requests):
        return [self.table[len(r.continuation)] for r in requests]


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]  # one token per character


def test_accuracy_from_known_logprobs():
    # Choice texts of 2 and 8 characters (3 and 9 tokens with the space). Raw logprob prefers the
    # short one (-3 > -4); per character the long one wins (-4/8 > -3/2).
    table = {3: Loglikelihood(-3.0, False, 3), 9: Loglikelihood(-4.0, False, 9)}
    questions = [
        Question(("q",) * 2, (" ab", " abcdefgh"), gold=0, choice_lengths=(2, 8)),
        Question(("q",) * 2, (" ab", " abcdefgh"), gold=1, choice_lengths=(2, 8)),
        Question(("q",) * 2, (" abcdefgh", " ab"), gold=1, choice_lengths=(8, 2)),
    ]
    results = evaluate_multiple_choice(TableScorer(table), FakeTokenizer(), "piqa", questions)
    assert results["correct"] == [1, 0, 1]
    assert results["acc"] == pytest.approx(2 / 3)
    assert results["acc_norm"] == pytest.approx(1 / 3)
    assert results["acc_stderr"] == pytest.approx(math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2 / 3))


def test_lambada_accuracy_is_greedy_match_and_perplexity_per_document():
    table = {6: Loglikelihood(-1.0, True, 6), 4: Loglikelihood(-3.0, False, 4)}
    questions = [
        Question(("ctx",), (" words",), 0, (5,)),  # 6 tokens: greedy
        Question(("ctx",), (" dog",), 0, (3,)),  # 4 tokens: not greedy
    ]
    results = evaluate_multiple_choice(TableScorer(table), FakeTokenizer(), "lambada", questions)
    assert results["acc"] == 0.5 and results["correct"] == [1, 0]
    assert results["perplexity"] == pytest.approx(math.exp(2.0))  # exp(-mean(-1, -3))

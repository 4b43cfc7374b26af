"""Scoring functions on hand-made cases: known logprobs give known accuracies, known texts known scores."""

from __future__ import annotations

import math

import pytest

from kvserve.eval.metrics import (
    ChoiceScores,
    choice_accuracy,
    contains_answer,
    exact_match,
    mean,
    mean_stderr,
    normalize_answer,
    option_letter,
    perplexity,
    rouge_l,
    token_f1,
)


def test_choice_accuracy_raw_and_length_normalised():
    # Raw: choice 1 (-4.0) beats choice 0 (-6.0). Per character: 0 is -6/12 = -0.5, 1 is -4/2 = -2.0.
    question = ChoiceScores(logprobs=[-6.0, -4.0], lengths=[12, 2], gold=0)
    assert choice_accuracy(question) == (0.0, 1.0)
    assert choice_accuracy(ChoiceScores([-6.0, -4.0], [12, 2], gold=1)) == (1.0, 0.0)


def test_choice_accuracy_ties_go_to_the_first_choice():
    assert choice_accuracy(ChoiceScores([-1.0, -1.0, -3.0], [1, 1, 1], gold=0)) == (1.0, 1.0)
    assert choice_accuracy(ChoiceScores([-1.0, -1.0, -3.0], [1, 1, 1], gold=1)) == (0.0, 0.0)


def test_choice_accuracy_rejects_a_gold_outside_the_choices():
    with pytest.raises(ValueError, match="gold choice 2 is outside the 2 choices"):
        choice_accuracy(ChoiceScores([-1.0, -2.0], [1, 1], gold=2))


def test_mean_and_stderr_match_lm_eval():
    values = [1.0, 0.0, 1.0, 1.0]  # mean 0.75; sample sd sqrt(0.25) = 0.5; stderr 0.5 / 2
    assert mean(values) == 0.75
    assert mean_stderr(values) == pytest.approx(0.25)
    assert math.isnan(mean_stderr([1.0]))
    with pytest.raises(ValueError):
        mean([])


def test_perplexity_is_exp_of_mean_nll():
    assert perplexity(-2 * math.log(4.0), 2) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        perplexity(0.0, 0)


def test_answer_normalisation_and_matching():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Eiffel", "Eiffel tower") == 0.0
    assert contains_answer("I think it was the role of art in society, mostly.", "The role of art in society") == 1.0
    assert contains_answer("artistic roles", "art") == 0.0  # whole words only
    assert contains_answer("anything", "") == 0.0


def test_token_f1():
    assert token_f1("april 25 2018", "April 25 , 2018") == 1.0
    # prediction "25 april" vs reference "april 25 2018": 2 common, P = 1, R = 2/3, F1 = 0.8
    assert token_f1("25 april", "April 25, 2018") == pytest.approx(0.8)
    assert token_f1("nothing here", "13") == 0.0
    assert token_f1("", "") == 1.0


def test_option_letter():
    assert option_letter("(B) Their subconscious knew") == "B"
    assert option_letter("The answer is C.") == "C"
    assert option_letter("A") == "A"
    assert option_letter("I am not sure") is None  # the article "a"/"I" are not options
    assert option_letter("Answer: (D)") == "D"


def test_rouge_l_uses_the_longest_common_subsequence():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # LCS "the cat sat" = 3 of 3 predicted and 3 of 6 reference tokens: F = 2 * 1 * 0.5 / 1.5
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    assert rouge_l("dogs bark", "the cat sat") == 0.0

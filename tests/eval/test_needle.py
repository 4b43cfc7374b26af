"""Needle in a haystack: haystack building, depth and length, scoring, the heatmap, and a short real run."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.eval import needle
from kvserve.eval.needle import (
    build_cells,
    clean_text,
    draw_needle_heatmap,
    evaluate_needle,
    insert_needle,
    load_haystack_tokens,
    needle_headline,
    needle_value,
    score_answer,
    sentence_boundaries,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VALUE = re.compile(r"'([a-z]+-[a-z]+-\d{3})'")


class WordTokenizer:
    """One token per word with its leading whitespace: decode(encode(text)) == text, lengths easy to count."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.ids: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._id(piece) for piece in re.findall(r"\s*\S+|\s+", text)]

    def _id(self, piece: str) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(f"<system> be helpful <user> {messages[-1]['content']} <assistant>")


@dataclass
class FakeEngine:
    tokenizer: WordTokenizer
    max_model_len: int = 4096


def _text(path: Path, sentences: int = 400) -> Path:
    lines = [f"Sentence number {i} is here, and it is short." for i in range(sentences)]
    paragraphs = ["\n".join(lines[i : i + 5]) for i in range(0, sentences, 5)]  # hard-wrapped, like Gutenberg
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def _haystack_words_before_needle(prompt: str) -> tuple[int, int]:
    document = prompt.split("<text>\n", 1)[1].split("\n</text>", 1)[0]
    before, after = re.split(r" ?The secret passphrase for the vault is '[^']+'\.", document)
    return len(before.split()), len(before.split()) + len(after.split())


def test_clean_text_joins_wrapped_lines_and_keeps_paragraphs() -> None:
    assert clean_text("One two\nthree.\n\n\nFour\n  five.\n") == "One two three.\n\nFour five."


def test_sentence_boundaries() -> None:
    text = 'He said "yes." Then _no!_ Why? Mr. and Mrs. Weston, Done\n\nCHAPTER II\n\nEnd'
    cuts = sentence_boundaries(text)
    assert cuts[0] == 0 and cuts[-1] == len(text)
    ends = [text[:c].rsplit(" ", 1)[-1] for c in cuts[1:-1]]
    assert ends == ['"yes."', "_no!_", "Why?", "Done", "II"]  # not after "Mr." or "Mrs."


def test_insert_needle_at_boundaries() -> None:
    text = "One. Two.\n\nThree."
    assert insert_needle(text, "N.", 0) == "N. One. Two.\n\nThree."
    assert insert_needle(text, "N.", 4) == "One. N. Two.\n\nThree."
    assert insert_needle(text, "N.", 9) == "One. Two. N.\n\nThree."
    assert insert_needle(text, "N.", len(text)) == "One. Two.\n\nThree. N."


def test_needle_values_are_seeded_and_vary_per_cell() -> None:
    assert needle_value(0, 1024, 0.5) == needle_value(0, 1024, 0.5)
    assert re.fullmatch(r"[a-z]+-[a-z]+-\d{3}", needle_value(0, 1024, 0.5))
    values = {needle_value(0, n, d) for n in (1024, 2048) for d in (0.0, 0.25, 0.5, 0.75, 1.0)}
    assert len(values) >= 9
    assert needle_value(1, 1024, 0.5) != needle_value(0, 1024, 0.5) or needle_value(1, 1024, 0.0) != needle_value(
        0, 1024, 0.0
    )


def test_score_answer_is_exact_retrieval() -> None:
    assert score_answer("The secret passphrase for the vault is 'amber-falcon-731'.", "amber-falcon-731") == 1.0
    assert score_answer('"Amber-Falcon-731."', "amber-falcon-731") == 1.0  # case is not retrieval
    assert score_answer("amber-falcon-73", "amber-falcon-731") == 0.0
    assert score_answer("amber falcon 731", "amber-falcon-731") == 0.0
    assert score_answer("", "amber-falcon-731") == 0.0


@pytest.mark.parametrize("length", [200, 600, 1500])
def test_cells_have_the_requested_length_depth_and_a_sentence_boundary(tmp_path: Path, length: int) -> None:
    tokenizer = WordTokenizer()
    haystack = load_haystack_tokens(tokenizer, length, _text(tmp_path / "text.txt"))
    depths = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    cells = build_cells(tokenizer, haystack, length, depths)
    assert [c.depth for c in cells] == depths
    shared = None
    for cell in cells:
        assert length - 3 <= len(cell.prompt_ids) <= length  # the whole prompt is the length
        prompt = tokenizer.decode(cell.prompt_ids)
        assert prompt.count("The secret passphrase for the vault is") == 1
        assert VALUE.search(prompt).group(1) == cell.value
        before, total = _haystack_words_before_needle(prompt)
        assert total == cell.haystack_tokens
        tolerance = 5 / total + 1e-9  # half a sentence (ten words) either side
        assert abs(before / total - cell.depth) <= tolerance
        assert abs(cell.actual_depth - before / total) <= 1e-9
        document = prompt.split("<text>\n", 1)[1]
        at = document.index("The secret passphrase")
        at_end = document[at:].startswith(f"The secret passphrase for the vault is '{cell.value}'.\n</text>")
        assert at == 0 or at_end or document[at - 2] in ".!?"  # the start, the end, or after a sentence end
        # every depth of one length shares the haystack: same text once the needle is taken out
        haystack_text = " ".join(re.sub(r"The secret passphrase for the vault is '[^']+'\.", "", prompt).split())
        assert shared is None or haystack_text == shared
        shared = haystack_text


def test_cells_of_a_length_share_the_prompt_prefix(tmp_path: Path) -> None:
    tokenizer = WordTokenizer()
    haystack = load_haystack_tokens(tokenizer, 600, _text(tmp_path / "text.txt"))
    shallow, deep = build_cells(tokenizer, haystack, 600, [0.3, 0.8])
    common = next(i for i, (a, b) in enumerate(zip(shallow.prompt_ids, deep.prompt_ids, strict=False)) if a != b)
    assert common >= 0.3 * shallow.haystack_tokens


def test_length_without_room_for_text_is_an_error(tmp_path: Path) -> None:
    tokenizer = WordTokenizer()
    haystack = load_haystack_tokens(tokenizer, 100, _text(tmp_path / "text.txt"))
    with pytest.raises(ValueError, match="haystack length 20 leaves no room"):
        build_cells(tokenizer, haystack, 20, [0.5])


def test_lengths_beyond_the_context_are_an_error(tmp_path: Path) -> None:
    engine = FakeEngine(WordTokenizer(), max_model_len=1024)
    with pytest.raises(ValueError, match=r"length\(s\) 1000, 2048 do not fit.* 1024 tokens.* at most 992"):
        evaluate_needle(engine, [512, 1000, 2048], [0.5], text=_text(tmp_path / "text.txt"))
    with pytest.raises(ValueError, match="fractions"):
        evaluate_needle(engine, [512], [50.0], text=_text(tmp_path / "text.txt"))


@dataclass
class _Completion:
    text: str


@dataclass
class _Output:
    outputs: list[_Completion]


def test_evaluate_needle_grid_records_and_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(WordTokenizer())
    seen = []

    def fake_generate(self, prompts, params, use_tqdm=True):
        seen.append((prompts, params))
        outputs = []
        for ids in prompts:
            value = VALUE.search(engine.tokenizer.decode(ids)).group(1)
            depth_words = _haystack_words_before_needle(engine.tokenizer.decode(ids))
            found = depth_words[0] / depth_words[1] < 0.6  # this "model" only sees the first 60%
            outputs.append(_Output([_Completion(f"It is '{value}'." if found else "I do not know.")]))
        return outputs

    monkeypatch.setattr("kvserve.entrypoints.llm.LLM.generate", fake_generate)
    lengths, depths = [300, 600], [0.0, 0.5, 1.0]
    results = evaluate_needle(engine, lengths, depths, text=_text(tmp_path / "text.txt"))

    assert len(seen) == 1 and len(seen[0][0]) == 6  # every cell in one batch
    assert seen[0][1].temperature == 0.0 and seen[0][1].max_tokens == needle.NEEDLE_MAX_TOKENS
    assert results["lengths"] == lengths and results["depths"] == depths
    assert results["scores"] == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]  # [depth][length]
    assert results["mean_score"] == pytest.approx(4 / 6)
    assert [(c["length"], c["depth"]) for c in results["cells"]] == [(n, d) for n in lengths for d in depths]
    for cell in results["cells"]:
        assert set(cell) >= {"length", "depth", "prompt_tokens", "answer", "score", "needle", "actual_depth"}
        assert cell["prompt_tokens"] <= cell["length"]
    assert results["seconds"] >= 0
    json.dumps(results)  # goes into the JSON report as is
    assert needle_headline(results) == "needle retrieval 0.667 over 6 cells (lengths 300-600 tokens)"


def _results(lengths: list[int], depths: list[float]) -> dict:
    scores = [[(i + j) % 3 / 2 for j in range(len(lengths))] for i in range(len(depths))]
    cells = [
        {"length": n, "depth": d, "score": scores[i][j]} for j, n in enumerate(lengths) for i, d in enumerate(depths)
    ]
    mean = sum(c["score"] for c in cells) / len(cells)
    return {"lengths": lengths, "depths": depths, "scores": scores, "cells": cells, "mean_score": mean}


def test_heatmap_is_written(tmp_path: Path) -> None:
    results = _results([1024, 2048, 4096, 8192], [i / 10 for i in range(11)])
    path = tmp_path / "plots" / "needle.png"
    draw_needle_heatmap(results, path, title="kvserve float32")
    assert path.read_bytes()[:8] == PNG_MAGIC
    draw_needle_heatmap(_results([256], [0.5]), tmp_path / "one.png")  # a single cell, no title
    assert (tmp_path / "one.png").read_bytes()[:8] == PNG_MAGIC


def test_headline_with_one_length() -> None:
    assert needle_headline(_results([1024], [0.0, 1.0])).endswith("over 2 cells (lengths 1024 tokens)")


@pytest.mark.real_model
def test_needle_real_model_short_run(default_model, tmp_path: Path) -> None:
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine

    engine = LLMEngine(EngineConfig(), default_model)
    results = evaluate_needle(engine, [256, 512], [0.0, 0.5, 1.0])
    assert results["lengths"] == [256, 512] and results["depths"] == [0.0, 0.5, 1.0]
    assert len(results["scores"]) == 3 and all(len(row) == 2 for row in results["scores"])
    assert len(results["cells"]) == 6
    for cell in results["cells"]:
        assert cell["length"] - 16 <= cell["prompt_tokens"] <= cell["length"]
        assert abs(cell["actual_depth"] - cell["depth"]) <= 0.25  # one Austen sentence can be long
        assert isinstance(cell["answer"], str) and cell["score"] in (0.0, 1.0)
    assert 0.0 <= results["mean_score"] <= 1.0
    json.dumps(results)
    draw_needle_heatmap(results, tmp_path / "needle.png", title="real")
    assert (tmp_path / "needle.png").read_bytes()[:8] == PNG_MAGIC

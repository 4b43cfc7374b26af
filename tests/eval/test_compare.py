"""``kvserve eval compare`` on hand-made reports: table contents, deltas and noise, errors, warnings, plots."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvserve.eval.compare import compare_table, draw_comparison, kv_setting, main_metric

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHA = "ab" * 32


def _report(kind: str, results: dict, *, dtype: str = "float32", options: dict | None = None, **engine) -> dict:
    return {
        "eval": kind,
        "headline": f"{kind} headline",
        "results": results,
        "backend": "kvserve",
        "engine": {"dtype": dtype, "block_size": 16, "enable_prefix_caching": True, **engine},
        "model": {"path": "/models/smollm2.gguf", "sha256": SHA, "bytes": 1000},
        "options": options if options is not None else {},
    }


def _mc(acc: float, stderr: float, correct: list[int] | None = None, **kw) -> dict:
    results = {"task": "piqa", "num_questions": 1000, "acc": acc, "acc_stderr": stderr, "acc_norm": acc,
               "acc_norm_stderr": stderr}  # fmt: skip
    if correct is not None:
        results["correct"] = correct
    return _report("mc", results, options={"task": "piqa", "limit": None}, **kw)


def _ppl(perplexity: float, **kw) -> dict:
    results = {"perplexity": perplexity, "word_perplexity": perplexity * 2, "bits_per_byte": 0.9, "scored_tokens": 9}
    return _report("ppl", results, options={"data": "/data/wikitext-2/wiki.test.raw", "context": 2048}, **kw)


def _needle(scores: list[float], **kw) -> dict:
    cells = [{"length": 1024, "depth": i / max(len(scores) - 1, 1), "score": s} for i, s in enumerate(scores)]
    results = {"lengths": [1024], "depths": [c["depth"] for c in cells], "scores": [[s] for s in scores],
               "cells": cells, "mean_score": sum(scores) / len(scores)}  # fmt: skip
    return _report("needle", results, options={"lengths": [1024]}, **kw)


def _rows(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")]


def test_mc_table_rows_deltas_and_noise() -> None:
    reports = [
        _mc(0.6800, 0.0110),
        _mc(0.6750, 0.0110, dtype="bfloat16"),
        _mc(0.6000, 0.0120, kv_policy="pyramid", kv_budget=0.25),
    ]
    table = compare_table(reports, ["fp32", "bf16", "pyr25"])
    rows = _rows(table)
    assert rows[0] == ["report", "eval", "backend", "dtype", "KV policy", "KV kept", "acc ± stderr", "Δ vs fp32"]
    assert rows[1] == ["---"] * 8
    assert rows[2] == ["fp32", "mc/piqa", "kvserve", "float32", "full", "100%", "0.6800 ± 0.0110", "—"]
    assert rows[3] == ["bf16", "mc/piqa", "kvserve", "bfloat16", "full", "100%", "0.6750 ± 0.0110",
                       "-0.0050 (within noise)"]  # fmt: skip
    assert rows[4] == ["pyr25", "mc/piqa", "kvserve", "float32", "pyramid", "25%", "0.6000 ± 0.0120",
                       "-0.0800 (beyond 2 stderr)"]  # fmt: skip
    assert "warning" not in table


def test_noise_threshold_is_two_stderr_of_the_difference() -> None:
    se = 0.01  # difference stderr sqrt(2) * 0.01 = 0.01414; two of them 0.0283
    inside = compare_table([_mc(0.5, se), _mc(0.528, se)], ["a", "b"])
    outside = compare_table([_mc(0.5, se), _mc(0.529, se)], ["a", "b"])
    assert _rows(inside)[3][-1] == "+0.0280 (within noise)"
    assert _rows(outside)[3][-1] == "+0.0290 (beyond 2 stderr)"


def test_per_question_results_give_a_paired_difference() -> None:
    # The same 100 questions; b gets 6 more right and none wrong that a had right. Unpaired stderrs
    # (0.05 each, 2 x 0.0707) call +0.06 noise; the paired one (sqrt(0.06 * 0.94 / 99) = 0.0239) does not.
    a = [1] * 50 + [0] * 50
    b = [1] * 56 + [0] * 44
    table = compare_table([_mc(0.50, 0.05, a), _mc(0.56, 0.05, b)], ["a", "b"])
    assert _rows(table)[3][-1] == "+0.0600 (beyond 2 stderr)"
    unpaired = compare_table([_mc(0.50, 0.05), _mc(0.56, 0.05)], ["a", "b"])
    assert _rows(unpaired)[3][-1] == "+0.0600 (within noise)"


def test_ppl_table_has_relative_delta_and_no_stderr() -> None:
    table = compare_table([_ppl(20.0), _ppl(20.5, dtype="bfloat16")], ["fp32", "bf16"])
    rows = _rows(table)
    assert rows[0][6] == "perplexity ± stderr"
    assert rows[2][1] == "ppl/wiki.test.raw"
    assert rows[2][6:] == ["20.000", "—"]
    assert rows[3][6:] == ["20.500", "+0.500 (+2.5%)"]


def test_longqa_reads_the_generic_score() -> None:
    results = {"task": "quality", "metric": "exact_match", "score": 0.42, "score_stderr": 0.03}
    other = dict(results, score=0.40)
    reports = [_report("longqa", results), _report("longqa", other, kv_policy="infinigen", kv_budget=0.5)]
    rows = _rows(compare_table(reports, ["full", "ig50"]))
    assert rows[0][6] == "exact_match ± stderr"
    assert rows[3] == ["ig50", "longqa/quality", "kvserve", "float32", "infinigen", "50%", "0.4000 ± 0.0300",
                       "-0.0200 (within noise)"]  # fmt: skip
    assert main_metric(_report("longqa", {"score": 0.3})).name == "score"
    with pytest.raises(ValueError, match="no 'score'"):
        main_metric(_report("longqa", {"rouge": 0.3}))


def test_needle_metric_is_the_mean_score_with_a_cell_stderr() -> None:
    metric = main_metric(_needle([1.0, 1.0, 0.0, 1.0]))
    assert metric.name == "retrieval" and metric.value == 0.75
    assert metric.stderr == pytest.approx(0.25)  # sqrt(0.25 / 3 / 4)
    rows = _rows(compare_table([_needle([1.0, 1.0, 0.0, 1.0]), _needle([1.0, 0.0, 0.0, 1.0])], ["a", "b"]))
    assert rows[3][6] == "0.5000 ± 0.2887"


def test_kv_setting_defaults_to_the_full_cache() -> None:
    assert kv_setting(_mc(0.5, 0.01)) == ("full", 1.0)
    assert kv_setting(_mc(0.5, 0.01, kv_policy="pyramid", kv_budget=0.3)) == ("pyramid", 0.3)
    assert kv_setting(_mc(0.5, 0.01, kv_policy=None, kv_budget=None)) == ("full", 1.0)


def test_mixed_kinds_are_an_error_naming_them() -> None:
    with pytest.raises(ValueError, match=r"different eval kinds \(a: ppl, b: mc\)"):
        compare_table([_ppl(20.0), _mc(0.5, 0.01)], ["a", "b"])
    with pytest.raises(ValueError, match="different eval kinds"):
        draw_comparison([_ppl(20.0), _mc(0.5, 0.01)], ["a", "b"], Path("unused.png"))
    with pytest.raises(ValueError, match="no reports"):
        compare_table([], [])


def test_warnings_for_different_models_tasks_and_options() -> None:
    other = _mc(0.55, 0.01)
    other["model"] = dict(other["model"], sha256="cd" * 32)
    other["results"] = dict(other["results"], task="copa")
    other["options"] = {"task": "copa", "limit": 100}
    table = compare_table([_mc(0.5, 0.01), other], ["a", "b"])
    warnings = [line for line in table.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3
    assert "different model files" in warnings[0] and "a abababababab" in warnings[0]
    assert "b cdcdcdcdcdcd" in warnings[0]
    assert "mc/copa, mc/piqa" in warnings[1]
    assert "different options (limit, task)" in warnings[2]


def test_bar_chart_when_budgets_are_equal(tmp_path: Path) -> None:
    path = tmp_path / "out" / "bars.png"
    draw_comparison([_mc(0.68, 0.011), _mc(0.675, 0.011, dtype="bfloat16")], ["fp32", "bf16"], path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    draw_comparison([_ppl(20.0), _ppl(20.5)], ["a", "b"], tmp_path / "ppl.png")  # no error bars
    assert (tmp_path / "ppl.png").read_bytes()[:8] == PNG_MAGIC


def test_budget_lines_when_budgets_differ(tmp_path: Path) -> None:
    reports = [_mc(0.68, 0.011)]
    for policy, drop in (("pyramid", 0.1), ("infinigen", 0.04)):
        for budget in (0.75, 0.5, 0.25):
            reports.append(_mc(0.68 - drop * (1 - budget), 0.011, kv_policy=policy, kv_budget=budget))
    names = [f"r{i}" for i in range(len(reports))]
    path = tmp_path / "budget.png"
    draw_comparison(reports, names, path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    table = compare_table(reports, names)
    assert len(_rows(table)) == 2 + len(reports)


def test_inputs_are_not_modified(tmp_path: Path) -> None:
    reports = [_needle([1.0, 0.0]), _needle([1.0, 1.0], kv_policy="pyramid", kv_budget=0.5)]
    before = copy.deepcopy(reports)
    compare_table(reports, ["a", "b"])
    draw_comparison(reports, ["a", "b"], tmp_path / "n.png")
    assert reports == before

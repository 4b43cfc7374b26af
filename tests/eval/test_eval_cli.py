"""``kvserve eval``: option parsing, reports and headlines; both backends on a tiny checkpoint; a short
real run on the default model."""

from __future__ import annotations

import json
import re

import pytest

from kvserve.entrypoints.cli import main
from kvserve.eval.cli import parse_depths, parse_lengths
from tests.tiny_models import TinySpec, write_tiny_model


def test_parse_lengths_and_depths():
    assert parse_lengths("1k,2k,4k,8k") == [1000, 2000, 4000, 8000]
    assert parse_lengths("1500, 0.5k") == [1500, 500]
    assert parse_depths("0..100%") == pytest.approx([i / 10 for i in range(11)])
    assert parse_depths("0..100%/5") == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert parse_depths("0,50%,100") == [0.0, 0.5, 1.0]
    for bad in ("1m", "", "8"):
        with pytest.raises(ValueError):
            parse_lengths(bad)
    for bad in ("0..120%", "x", "50..10%"):
        with pytest.raises(ValueError):
            parse_depths(bad)


def run(capsys, *argv: str) -> list[str]:
    assert main(["eval", *argv]) == 0
    return capsys.readouterr().out.strip().splitlines()


@pytest.mark.slow
def test_both_backends_agree_on_a_tiny_checkpoint(tmp_path, capsys):
    folder = write_tiny_model(tmp_path / "tiny", TinySpec(seed=3))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    common = ["--model", str(folder), "--data", str(text), "--context", "32", "--stride", "16", "--threads", "1"]
    common += ["--dtype", "float32"]  # the two backends agree to 1e-4 in float32
    ours = run(capsys, "ppl", *common, "--output", str(tmp_path / "ours.json"))
    run(capsys, "ppl", *common, "--backend", "hf", "--output", str(tmp_path / "hf.json"))
    assert re.fullmatch(r"perplexity \d+\.\d{3} over [\d,]+ tokens", ours[-1])
    assert ours[-2] == f"wrote {tmp_path / 'ours.json'}"
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ours", "hf"))
    assert (a["backend"], b["backend"]) == ("kvserve", "transformers")
    assert a["results"]["perplexity"] == pytest.approx(b["results"]["perplexity"], rel=1e-4)
    assert a["results"]["scored_tokens"] == b["results"]["scored_tokens"]


def test_bad_options_are_clear_errors(tmp_path, capsys):
    folder = write_tiny_model(tmp_path / "tiny", TinySpec(seed=3))
    assert main(["eval", "ppl", "--model", str(folder), "--data", str(tmp_path / "none.txt")]) == 2
    assert "none.txt is missing" in capsys.readouterr().err
    assert main(["eval", "ppl", "--model", str(folder), "--data", "austen", "--limit-tokens", "1"]) == 2
    assert "--limit-tokens must be >= 2, got 1" in capsys.readouterr().err
    assert main(["eval", "compare", str(tmp_path / "nothing.json")]) == 2
    assert "not a readable eval report" in capsys.readouterr().err


@pytest.mark.real_model
def test_real_model_reports_and_compare(tmp_path, capsys, shared_real_loads):
    base = ["--limit-tokens", "300", "--context", "128", "--dtype", "float32"]
    lines = run(capsys, "ppl", *base, "--stride", "64", "--output", str(tmp_path / "s64.json"))
    assert re.fullmatch(r"perplexity \d+\.\d{3} over 299 tokens", lines[-1])
    report = json.loads((tmp_path / "s64.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{64}", report["model"]["sha256"])
    assert report["engine"]["dtype"] == "float32" and report["engine"]["enable_prefix_caching"] is True
    assert report["options"] == {"data": report["options"]["data"], "context": 128, "stride": 64, "limit_tokens": 300}
    assert 1.0 < report["results"]["perplexity"] < 200.0  # a trained model on English prose
    run(capsys, "ppl", *base, "--stride", "128", "--output", str(tmp_path / "s128.json"))
    # Less history per token (stride 128 = no overlap) cannot predict better on average.
    worse = json.loads((tmp_path / "s128.json").read_text())["results"]["perplexity"]
    assert worse > report["results"]["perplexity"]
    table = run(capsys, "compare", str(tmp_path / "s64.json"), str(tmp_path / "s128.json"),
                "--output", str(tmp_path / "cmp.png"))  # fmt: skip
    assert any("s128" in line for line in table) and (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"

    lines = run(capsys, "mc", "--task", "copa", "--limit", "20", "--output", str(tmp_path / "copa.json"))
    assert re.fullmatch(r"copa accuracy \d\.\d{4} ± \d\.\d{4} over 20 questions", lines[-1])
    results = json.loads((tmp_path / "copa.json").read_text())["results"]
    assert len(results["correct"]) == 20 and results["acc"] == sum(results["correct"]) / 20

"""The KV policy options on the commands: eval reports the policy, generate streams through it, and
`bench compression` writes a consistent report, all on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.cli import main
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=4, max_position_embeddings=1024, seed=5)


@pytest.mark.slow
def test_eval_ppl_under_a_policy_names_it_and_costs_something(tmp_path, capsys) -> None:
    folder = write_tiny_model(tmp_path / "tiny", SPEC)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and the cat sat on the mat. " * 40)
    common = ["eval", "ppl", "--model", str(folder), "--data", str(text), "--context", "256", "--stride", "64"]
    common += ["--dtype", "float32", "--threads", "1", "--swap-space", "0"]
    assert main([*common, "--output", str(tmp_path / "full.json")]) == 0
    assert main([*common, "--kv-policy", "local", "--kv-budget", "0.1", "--output", str(tmp_path / "local.json")]) == 0
    full, local = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "local"))
    assert local["engine"]["kv_policy"] == "local" and local["engine"]["kv_budget"] == 0.1
    assert local["results"]["scored_tokens"] == full["results"]["scored_tokens"]
    assert local["results"]["perplexity"] != full["results"]["perplexity"]
    capsys.readouterr()
    assert main([*common, "--kv-policy", "pyramid", "--kv-budget", "1.5"]) == 2
    assert "kv_budget must be in (0, 1], got 1.5" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_and_bench_compression(tmp_path, capsys) -> None:
    folder = write_tiny_model(tmp_path / "tiny", SPEC)
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    argv = ["generate", prompt, "--model", str(folder), "--max-tokens", "8", "--dtype", "float32"]
    assert main([*argv, "--kv-policy", "h2o", "--kv-budget", "0.3"]) == 0
    assert capsys.readouterr().out.startswith(prompt)
    out = tmp_path / "cmp"
    argv = ["bench", "compression", "--model", str(folder), "--dtype", "float32", "--num-requests", "6"]
    argv += ["--prompt-tokens", "200,300", "--max-tokens", "8", "--kv-cache-memory", "600KiB", "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    full, pyramid, h2o = report["results"]
    assert [r["policy"] for r in (full, pyramid, h2o)] == ["full", "pyramid", "h2o"]
    assert all(r["output_tokens"] == 6 * 8 for r in report["results"])
    assert all(isinstance(r["preemptions"], int) and r["preemptions"] >= 0 for r in report["results"])
    assert pyramid["kv_bytes_per_seq"] < 0.6 * full["kv_bytes_per_seq"]
    assert pyramid["peak_running"] > full["peak_running"]
    assert out.with_suffix(".png").stat().st_size > 0 and "| pyramid | 0.5 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_bench_compression_runs_each_budget_and_the_full_cache_once(tmp_path) -> None:
    folder = write_tiny_model(tmp_path / "tiny", SPEC)
    out = tmp_path / "budgets"
    argv = ["bench", "compression", "--model", str(folder), "--dtype", "float32", "--num-requests", "4"]
    argv += ["--prompt-tokens", "200,300", "--max-tokens", "4", "--kv-cache-memory", "600KiB", "--output", str(out)]
    assert main([*argv, "--policies", "full,snapkv", "--kv-budget", "0.25,0.75"]) == 0
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["policy"], r["budget"]) for r in results] == [("full", 1.0), ("snapkv", 0.25), ("snapkv", 0.75)]
    assert results[1]["kv_bytes_per_seq"] < results[2]["kv_bytes_per_seq"] < results[0]["kv_bytes_per_seq"]


def test_bench_compression_refuses_an_unknown_preemption_mode(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:  # argparse: not one of the choices, before any model loads
        main(["bench", "compression", "--preemption-mode", "evict"])
    assert exit_.value.code == 2
    assert "invalid choice: 'evict'" in capsys.readouterr().err

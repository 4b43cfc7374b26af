"""Prompt Cache on the commands, on a tiny checkpoint: `generate --schema --pml-prompt` streams an answer
(and names what is missing), and `bench prompt-cache` writes a report in both layouts whose numbers add up."""

from __future__ import annotations

import json

import pytest

from kvserve.entrypoints.cli import main
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=1024, seed=5)
SCHEMA = '<schema name="s"><module name="doc">the cat sat on the mat and then it ran off</module></schema>'


@pytest.mark.slow
def test_generate_with_a_schema_and_a_pml_prompt(tmp_path, capsys):
    folder = write_tiny_model(tmp_path / "tiny", SPEC)
    schema = tmp_path / "s.xml"
    schema.write_text(SCHEMA)
    base = ["generate", "--model", str(folder), "--dtype", "float32", "--max-tokens", "6"]
    assert main([*base, "--schema", str(schema), "--pml-prompt", '<prompt schema="s"><doc/> and so</prompt>']) == 0
    assert capsys.readouterr().out.strip()
    assert main([*base, "--pml-prompt", '<prompt schema="s"><doc/> and so</prompt>']) == 2
    assert "--pml-prompt needs the schema it imports from: --schema FILE" in capsys.readouterr().err
    assert main([*base, "--schema", str(schema), "--pml-prompt", '<prompt schema="s"><nope/> x</prompt>']) == 2
    assert "no module 'nope' at the top level of the schema" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["prefix", "behind-parameter"])
def test_bench_prompt_cache_report(tmp_path, layout):
    folder = write_tiny_model(tmp_path / "tiny", SPEC)
    out = tmp_path / "ttft"
    argv = ["bench", "prompt-cache", "--model", str(folder), "--dtype", "float32", "--threads", "1"]
    argv += ["--kv-cache-memory", "8MiB"]
    assert main([*argv, "--lengths", "64,128", "--questions", "2", "--layout", layout, "--output", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["layout"] == layout and report["lengths"] == [64, 128]
    rows = {(r["target_tokens"], r["method"]): r for r in report["results"]}
    assert len(rows) == 8 and all(len(r["ttft_s"]) == 2 for r in rows.values())
    for length in (64, 128):
        full = rows[(length, "no cache")]["computed_tokens"]
        assert full >= length  # the whole prompt, from scratch
        for tier in ("device", "host"):
            assert rows[(length, f"prompt cache ({tier})")]["computed_tokens"] < full - length / 2
        hit = rows[(length, "prefix cache")]["computed_tokens"]
        assert hit == full if layout == "behind-parameter" else hit < full - length / 2
    assert out.with_suffix(".png").stat().st_size > 0
    assert f"# Prompt Cache: time to first token ({layout})" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_generate_saves_modules_to_prompt_cache_dir_and_a_second_run_loads_them(tmp_path, capsys):
    folder = write_tiny_model(tmp_path / "tiny", SPEC)
    schema = tmp_path / "s.xml"
    schema.write_text(SCHEMA)
    modules = tmp_path / "modules"
    argv = ["generate", "--model", str(folder), "--dtype", "float32", "--max-tokens", "6", "--schema", str(schema)]
    argv += ["--prompt-cache-dir", str(modules), "--pml-prompt", '<prompt schema="s"><doc/> and so</prompt>']
    assert main(argv) == 0
    first = capsys.readouterr().out
    files = {p: p.stat().st_mtime_ns for p in modules.glob("*.safetensors")}
    assert files  # written before the command returned
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    assert {p: p.stat().st_mtime_ns for p in modules.glob("*.safetensors")} == files  # loaded, not encoded again

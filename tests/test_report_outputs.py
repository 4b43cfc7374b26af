"""Where ``kvserve bench`` and ``kvserve eval`` write by default (never the shipped benchmarks/), and that no
report carries a secret."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import pytest

from kvserve.bench.redact import command_line, redact_argv, redact_keys
from kvserve.entrypoints.cli import build_parser, main
from tests.eval.test_compare import _ppl
from tests.test_bench_serve import start_fake
from tests.tiny_models import write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SECRET = "sk-test-5ecret"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """``kvserve ARGS`` in this process, with sys.argv as the console script sets it (reports record it)."""
    monkeypatch.setattr(sys, "argv", ["kvserve", *args])
    return main(list(args))


@pytest.fixture
def fake_server():
    server, _ = start_fake()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_bench_serve_writes_under_kvserve_results_and_masks_the_api_key(fake_server, tmp_path, monkeypatch, capsys):
    write_tokenizer(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = run_cli(
        monkeypatch, "bench", "serve", "--base-url", fake_server, "--api-key", SECRET, "--tokenizer", str(tmp_path),
        "--workload", "synthetic", "--num-requests", "2", "--input-len", "8", "--output-len", "2",
    )  # fmt: skip
    assert code == 0
    out = work / "kvserve-results" / "serve" / "serve-fake-model"
    report_text, markdown = out.with_suffix(".json").read_text(), out.with_suffix(".md").read_text()
    assert sorted(p.name for p in work.rglob("*") if p.is_file()) == ["serve-fake-model.json", "serve-fake-model.md"]
    assert SECRET not in report_text and SECRET not in markdown and SECRET not in capsys.readouterr().out
    assert "--api-key ***" in json.loads(report_text)["command"] and "--api-key ***" in markdown


def test_eval_compare_writes_under_kvserve_results(tmp_path, monkeypatch):
    reports = []
    for name, value in (("a", 20.0), ("b", 21.0)):
        reports.append(tmp_path / f"{name}.json")
        reports[-1].write_text(json.dumps(_ppl(value)))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert run_cli(monkeypatch, "eval", "compare", *map(str, reports)) == 0
    assert (work / "kvserve-results" / "compare" / "compare.png").stat().st_size > 1000


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_every_subcommand_defaults_to_its_own_results_folder(command):
    for name, parser in subcommands(subcommands(build_parser())[command]).items():
        assert parser.get_default("output") is None, name
        assert parser.get_default("results_subcommand") == name, f"{command} {name} has no default output folder"
        output = next(a for a in parser._actions if a.dest == "output")
        assert f"kvserve-results/{name}/" in output.help, output.help


def test_no_bench_or_eval_module_writes_into_the_shipped_benchmarks_folder():
    """No string (or f-string) in kvserve/bench or kvserve/eval starts with benchmarks/: no default path there."""
    for path in sorted((ROOT / "kvserve" / "bench").glob("*.py")) + sorted((ROOT / "kvserve" / "eval").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            text = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
            assert not text.startswith("benchmarks/"), f"{path.name}:{node.lineno}: {text!r}"


def test_the_given_output_still_decides(tmp_path, monkeypatch, fake_server):
    write_tokenizer(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = run_cli(
        monkeypatch, "bench", "serve", "--base-url", fake_server, "--tokenizer", str(tmp_path), "--workload",
        "synthetic", "--num-requests", "1", "--input-len", "8", "--output-len", "1", "--output", "mine/run",
    )  # fmt: skip
    assert code == 0 and (tmp_path / "mine" / "run.json").is_file() and not (tmp_path / "kvserve-results").exists()


def test_secret_options_are_masked_in_every_spelling():
    argv = ["serve", "--api-key", SECRET, "--api-key=" + SECRET, "--api-k", SECRET, "--label", "api", "--model", "m"]
    assert redact_argv(argv) == [
        "serve", "--api-key", "***", "--api-key=***", "--api-k", "***", "--label", "api", "--model", "m",
    ]  # fmt: skip
    assert command_line(["bench", "serve", "--api-key", SECRET]) == "kvserve bench serve --api-key ***"
    assert redact_keys({"runs": [{"api_key": SECRET, "n": 1}], "api_key": None}) == {
        "runs": [{"api_key": "***", "n": 1}], "api_key": None,
    }  # fmt: skip

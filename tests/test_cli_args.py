"""The ``kvserve`` command line: --version, defaults in --help, a subcommand's own usage on a usage error, and
options refused before any model loads (one line, exit code 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import kvserve
from kvserve.entrypoints import cli, cli_common
from tests.tiny_models import TinySpec, write_tiny_model


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_version_names_kvserve_and_torch():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvserve {kvserve.__version__} (torch {torch.__version__})"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (
            ["generate"],
            ["--max-tokens MAX_TOKENS (default: 128)", "--top-k TOP_K (default: -1)", "--seed SEED (default: none)"],
        ),
        (["serve"], ["--port PORT (default: 8000)", "--block-size BLOCK_SIZE tokens per KV block (default: 16)"]),
        (["eval", "ppl"], ["(default: wikitext-2)", "tokens per window (default: 2048)", "(default: 1GiB)"]),
        (["bench", "speed"], ["--dtype {auto,float32,bfloat16}"]),
    ],
)
def test_help_shows_the_defaults(command, shown):
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # as wide as the terminal: compare words, not line breaks
    assert f"usage: kvserve {' '.join(command)} " in text
    for fragment in [*shown, "(default: auto)", "(default: native)"]:
        assert fragment in text, fragment


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [["bench", "speed"], ["serve"], ["eval", "mc", "--task", "piqa"], ["generate", "hi"]]
)
def test_a_usage_error_prints_the_subcommands_usage(command):
    result = run_cli(*command, "--bogus")
    assert result.returncode == 2
    name = " ".join(c for c in command if c not in ("hi", "--task", "piqa"))
    assert result.stderr.startswith(f"usage: kvserve {name} ")
    assert f"kvserve {name}: error: unrecognized arguments: --bogus" in result.stderr


def _refuse_loading(monkeypatch) -> None:
    def load_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli_common, "load_model", load_model)


SCHEMA = "<schema name='s'><module name='m'>text</module></schema>"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--kv-policy", "int4", "hi"], "kv_policy='int4' fetches from an offloaded cache"),
        (
            ["generate", "--kv-offload", "host", "--kv-policy", "h2o", "--kv-offload-path", ".", "hi"],
            "kv_offload_path is the disk tier's folder",
        ),
        (
            [
                "generate",
                "--kv-offload",
                "host",
                "--kv-policy",
                "infinigen",
                "--kv-pool-limit",
                "0.5",
                "--prefill-parallel",
                "2",
                "hi",
            ],
            "prefill_parallel must be 1",
        ),  # fmt: skip
        (
            ["generate", "--kv-policy", "pyramid", "--kv-offload", "disk", "--kv-pool-limit", "0.5", "hi"],
            "kv_pool_limit evicts by InfiniGen's selection counts",
        ),
        (["generate", "--batch-invariant", "--kv-policy", "h2o", "hi"], "it needs kv_policy='full'"),
        (
            ["generate", "--int8-activations", "--dtype", "bfloat16", "hi"],
            "int8_activations rounds float32 activations; this engine runs bfloat16: set dtype='float32'",
        ),
        (
            ["serve", "--int8-activations", "--dtype", "float32", "--weights", "dequant"],
            "it needs weights='native' or 'int4', got 'dequant'",
        ),
        (["generate", "--pml-prompt", "<prompt schema='s'/>"], "--pml-prompt needs the schema"),
        (["generate", "--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["generate", "--top-p", "2", "hi"], "top_p"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
        (["generate", "--threads", "0", "hi"], "--threads must be >= 1, got 0"),
        (
            ["generate", "--kv-policy", "h2o", "--prompt-cache-tier", "host", "--schema", "{schema}", "hi"],
            "--schema: a compressing kv_policy ('h2o') keeps each module's own slots per layer",
        ),
        (["generate", "--schema", "/nonexistent/s.xml", "hi"], "cannot read schema file '/nonexistent/s.xml'"),
        (["generate", "--device", "bogus", "hi"], "device 'bogus' is not a device name"),
        (["serve", "--kv-cache-memory", "12XB"], "memory size '12XB' is not a byte count"),
        (["serve", "--kv-cache-memory", "0"], "kv_cache_memory must be more than 0 bytes, got '0'"),
        (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (
            ["serve", "--kv-offload", "disk", "--prompt-cache-tier", "host", "--schema", "{schema}"],
            "--schema: an offloading engine keeps every block, modules' too, in its disk tier",
        ),
        (
            ["serve", "--kv-offload", "host", "--prompt-cache-dir", "{schema}.d"],
            "prompt_cache_dir saves modules read from the paged cache of one process: it needs kv_offload='none'",
        ),
        (["serve", "--kv-offload", "host", "--preemption-mode", "swap"], "preemption_mode='swap' does not apply"),
        (["serve", "--block-size", "0"], "block_size must be an integer >= 1, got 0"),
        (["serve", "--kv-pool-limit", "0.5"], "kv_pool_limit=0.5 limits an offloaded cache"),
        (["serve", "--max-queue", "0"], "--max-queue must be >= 1, got 0"),
        (["serve", "a.gguf", "--model", "b.gguf"], "two models given: 'a.gguf' (MODEL) and 'b.gguf' (--model)"),
        (["eval", "ppl", "--kv-budget", "1.5", "--kv-policy", "h2o"], "budget"),
        (["eval", "mc", "--task", "piqa", "--swap-space", "lots"], "memory size 'lots'"),
        (["bench", "throughput", "--kv-policy", "int4"], "kv_policy='int4' fetches from an offloaded"),
    ],
)
def test_invalid_options_are_refused_before_the_model_loads(argv, message, monkeypatch, capsys, tmp_path):
    schema = tmp_path / "s.xml"
    schema.write_text(SCHEMA)
    _refuse_loading(monkeypatch)
    assert cli.main([arg.replace("{schema}", str(schema)) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--kv-offload", "host", "--kv-policy", "pyramid", "--kv-pool-limit", "0.5", "hi"],
        ["serve", "--kv-policy", "local", "--prompt-cache-tier", "host", "--schema", "s.xml"],
        ["eval", "ppl", "--threads", "0"],
    ],
)
def test_a_refused_combination_fails_in_seconds_without_loading(argv, tmp_path):
    (tmp_path / "s.xml").write_text(SCHEMA)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.startswith("kvserve: error: ")
    assert result.stderr.count("\n") == 1, result.stderr  # no load log line, no traceback
    assert time.monotonic() - start < 30  # importing torch, not loading a model


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cuda:99" if torch.cuda.is_available() else "cuda", "bogus", "mps"])
def test_an_unavailable_device_is_refused_in_one_line(device):
    result = run_cli("serve", "--device", device)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"kvserve: error: device '{device}' ")
    assert f"this torch ({torch.__version__})" in lines[0]
    assert "runs kvserve on: cpu" in lines[0]


def test_what_needs_the_models_facts_is_checked_on_its_metadata_before_the_weights_load(monkeypatch, capsys, tmp_path):
    spec = TinySpec(arch="mistral", num_heads=4, num_kv_heads=2, num_layers=2, extra={"sliding_window": 8})
    windowed = str(write_tiny_model(tmp_path / "windowed", spec))
    capsys.readouterr()  # transformers' progress bar while writing the checkpoint
    _refuse_loading(monkeypatch)
    pool_limit = ["--kv-policy", "infinigen", "--kv-pool-limit", "0.5"]  # in place: windows could not find positions
    cases = [
        (["serve", windowed, "--prefill-parallel", "2", "--kv-policy", "pyramid"], "prefill (KV-Runahead) windows its"),
        (["generate", "--model", windowed, "--kv-offload", "host", *pool_limit, "hi"], "kv_pool_limit=0.5 overwrites"),
        (["serve", "--kv-cache-memory", "1KiB"], "kv_cache_memory='1KiB' holds no block; one block of 16 tokens"),
        (["eval", "ppl", "--model", windowed, "--kv-cache-memory", "100"], "kv_cache_memory='100' holds no block"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvserve: error: ") and err.count("\n") == 1, err
        assert message in err, err

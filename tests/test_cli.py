"""The ``kvserve`` command as a user runs it: a real subprocess on the real default model."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.real_model
def test_generate_streams_a_continuation_of_the_prompt(default_model):
    prompt = "The capital of France is"
    result = run_cli("generate", "--dtype", "float32", "--max-tokens", "12", "--threads", "1", prompt)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(prompt)
    continuation = result.stdout[len(prompt) :].strip()
    # The same greedy continuation the Python API gives.
    from kvserve import SamplingParams
    from kvserve.entrypoints.generation import Generator

    expected = Generator(default_model).generate(prompt, SamplingParams(max_tokens=12, temperature=0)).text
    assert continuation == expected.strip()
    assert "Paris" in continuation


@pytest.mark.real_model
def test_generate_chat_answers_with_template():
    result = run_cli("generate", "--chat", "--max-tokens", "24", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "<|im_start|>" not in result.stdout


@pytest.mark.slow
def test_missing_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run_cli("generate", "--model", str(missing), "hi")
    assert result.returncode == 2
    assert f"model path {missing} does not exist" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_bad_sampling_value_is_a_clear_error():
    result = run_cli("generate", "--temperature", "-1", "hi")
    assert result.returncode == 2
    assert "temperature must be >= 0 and finite, got -1.0" in result.stderr

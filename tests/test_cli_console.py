"""What ``kvserve generate`` shows on the console, run as a user runs it (a subprocess), mostly on a tiny checkpoint.

- stdout is the prompt (unless ``--no-echo``) and the continuation the Python API gives, then a newline;
  stderr ends with one summary line (prompt and cached tokens, TTFT, prompt and decode tokens/s) that
  ``--no-summary`` leaves out;
- with stdout and stderr on one unbuffered pipe, as in a terminal, no log line lands inside the text: the
  engine logs before the prompt is echoed, and lines logged while the text streams wait for its newline;
- with ``--prefill-parallel 2`` the summary says whether the prompt prefilled over 2 processes or here, and why,
  and the workers log nothing at INFO;
- a Python warning raised while the text streams is written to stderr after the text's newline, and a worker
  that prints writes to stderr, not into the text on stdout;
- the load progress is a tqdm bar on a terminal and draws nothing into a pipe or a log.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from kvserve.entrypoints.console import print_stream
from kvserve.entrypoints.generation import Generator
from kvserve.entrypoints.progress import DelayedProgress
from kvserve.log import get_logger
from kvserve.models.loader import load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, write_tiny_model

KVSERVE = str(Path(sys.executable).with_name("kvserve"))
SPEC = TinySpec(max_position_embeddings=512, seed=3)
PROMPT = "the quick brown fox jumps over the lazy dog"
LONG_PROMPT = " ".join([PROMPT] * 3)  # > 2 x 16 tokens: long enough for a parallel prefill over 2 processes
COMMON = ["--dtype", "float32", "--threads", "1", "--max-tokens", "8"]
SUMMARY = re.compile(
    r"INFO kvserve: prompt (\d+) tokens \((\d+) cached\), TTFT (\d+) ms, ([\d.]+|-) prompt tokens/s; "
    r"generated (\d+) tokens, ([\d.]+|-) decode tokens/s(?:; (.*))?\n"
)
LOG_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) kvserve: ")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("console"), SPEC))


@pytest.fixture(scope="module")
def expected(tiny) -> tuple[list[int], str, int]:
    """The prompt's ids, and the greedy continuation and its token count, from the Python API."""
    loaded = load_model(tiny, torch.float32)
    out = Generator(loaded).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))
    return out.prompt_token_ids, out.text, len(out.token_ids)


def generate(*args: str, merged: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """``kvserve generate ARGS``; ``merged``: stderr into stdout, both unbuffered, as a terminal shows them."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if merged else None
    stderr = subprocess.STDOUT if merged else subprocess.PIPE
    return subprocess.run([KVSERVE, "generate", *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def summary_of(stderr: str) -> re.Match:
    match = SUMMARY.search(stderr)
    assert match is not None, stderr
    assert stderr.endswith(match.group(0)), "the summary is the last line"
    return match


@pytest.mark.slow
def test_generate_prints_prompt_continuation_and_summary(tiny, expected):
    ids, text, generated = expected
    result = generate("--model", tiny, *COMMON, PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + text + "\n"
    summary = summary_of(result.stderr)
    assert int(summary.group(1)) == len(ids) and summary.group(2) == "0"
    assert int(summary.group(5)) == generated
    assert float(summary.group(4)) > 0 and summary.group(7) is None  # no parallel prefill asked for
    assert "\r" not in result.stderr and "\033[" not in result.stderr


@pytest.mark.slow
def test_no_echo_and_no_summary(tiny, expected):
    result = generate("--model", tiny, *COMMON, "--no-echo", "--no-summary", PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected[1] + "\n"
    assert SUMMARY.search(result.stderr) is None and "INFO kvserve: loaded" in result.stderr


@pytest.mark.slow
def test_logs_never_land_inside_the_text(tiny, expected):
    """The paged engine (a KV policy) logs its KV cache as it starts: before the echoed prompt, not after it."""
    result = generate("--model", tiny, *COMMON, "--kv-policy", "local", "--kv-budget", "0.9", PROMPT, merged=True)
    assert result.returncode == 0, result.stdout
    before, echoed, after = result.stdout.partition(PROMPT)
    assert echoed and "INFO kvserve: KV cache" in before
    # One request's blocks (prompt and max_tokens, per layer under this policy), not 1 GiB; no swap tier.
    assert int(re.search(r"KV cache: (\d+) blocks", before).group(1)) <= SPEC.num_layers * 8, before
    assert "host tier for swapping: 0 blocks" in before
    first_log = LOG_LINE.search(after)
    text = after[: first_log.start()]
    assert len(text) > 1 and text.endswith("\n"), after  # the whole continuation, then its newline
    assert all(LOG_LINE.match(line) for line in after[first_log.start() :].splitlines()), after
    summary_of(after)


def test_print_stream_holds_log_lines_until_the_newline(monkeypatch):
    """A line logged from another thread while the text streams is written after the text's newline."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s kvserve: %(message)s"))
    logger = get_logger()
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "level", logging.INFO)

    def deltas():
        yield "Hello"
        thread = threading.Thread(target=logger.info, args=("group restarted",))
        thread.start()
        thread.join()
        logger.warning("slow step")
        yield ", world"

    print_stream(deltas(), "Say: ", out)
    logger.info("after")
    assert out.getvalue() == "Say: Hello, world\nINFO kvserve: group restarted\nWARNING kvserve: slow step\n" + (
        "INFO kvserve: after\n"
    )
    assert logger.handlers == [handler]


def test_print_stream_holds_warnings_until_the_newline(monkeypatch):
    """A warning raised while the text streams is shown (on stderr, as Python shows it) after the text's newline."""
    out = io.StringIO()
    shown: list[str] = []

    def showwarning(message, category, filename, lineno, file=None, line=None):
        shown.append(f"{out.getvalue()!r}: {category.__name__}: {message}")

    monkeypatch.setattr(warnings, "showwarning", showwarning)

    def deltas():
        yield "Hello"
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("mid-stream", UserWarning, stacklevel=1)
        yield ", world"

    print_stream(deltas(), "Say: ", out)
    assert shown == ["'Say: Hello, world\\n': UserWarning: mid-stream"]
    assert warnings.showwarning is showwarning


NOISY_GENERATE = """
import sys
import warnings

import kvserve.parallel.group as group

_run_chunk = group.run_chunk


def worker_chunk(*args, **kwargs):
    print("a worker's print")
    warnings.warn("a worker's warning")
    return _run_chunk(*args, **kwargs)


def engine_chunk(*args, **kwargs):
    warnings.warn("a warning while the text streams")
    return _run_chunk(*args, **kwargs)


if __name__ == "__mp_main__":  # spawn runs this file again in each worker under this name
    group.run_chunk = worker_chunk
elif __name__ == "__main__":
    from kvserve.entrypoints.cli import main

    group.run_chunk = engine_chunk
    sys.exit(main(["generate", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_warnings_and_worker_prints_stay_off_stdout(tiny, tmp_path):
    """A warning in this process while the text streams, and a print and a warning in a prefill worker (which
    inherits this process's stdout): stdout is the prompt, the continuation and a newline, nothing else."""
    loaded = load_model(tiny, torch.float32)
    text = Generator(loaded).generate(LONG_PROMPT, SamplingParams(max_tokens=8, temperature=0)).text
    script = tmp_path / "noisy_generate.py"
    script.write_text(NOISY_GENERATE)
    args = ["--model", tiny, *COMMON, "--prefill-parallel", "2", "--prefill-partition", "even", LONG_PROMPT]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == LONG_PROMPT + text + "\n"
    assert "a worker's print" in result.stderr and "UserWarning: a worker's warning" in result.stderr
    assert "UserWarning: a warning while the text streams" in result.stderr
    summary = summary_of(result.stderr)
    assert summary.group(7) == f"prefill of {summary.group(1)} tokens over 2 processes"


@pytest.mark.slow
def test_summary_says_the_prompt_prefilled_over_two_processes(tiny):
    result = generate("--model", tiny, *COMMON, "--prefill-parallel", "2", "--prefill-partition", "even",
                      "--no-echo", LONG_PROMPT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of(result.stderr)
    assert summary.group(7) == f"prefill of {summary.group(1)} tokens over 2 processes"
    # Workers log warnings only: their lines, from other processes, could not be held back from a text.
    assert result.stderr.count("INFO kvserve: loaded") == 1, result.stderr


@pytest.mark.slow
def test_parallel_prefill_routes_name_why_a_prompt_ran_here(tiny):
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine

    config = EngineConfig(model=tiny, dtype="float32", prefill_parallel=2, prefill_partition="even",
                          enable_prefix_caching=False, kv_cache_memory="64MiB", swap_space="64MiB")  # fmt: skip
    params = SamplingParams(max_tokens=2, temperature=0)
    with LLMEngine(config) as engine:
        parallel = engine.parallel_prefill

        def route(prompt: str) -> str:
            engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            return parallel.last_route.describe()

        long_tokens = len(engine.tokenizer.encode(LONG_PROMPT))
        assert route(LONG_PROMPT) == f"prefill of {long_tokens} tokens over 2 processes"
        short = "the quick brown fox"
        here = f"prefill of {len(engine.tokenizer.encode(short))} tokens in this process"
        assert route(short) == f"{here}: fewer than 32 tokens (16 a process)"
        parallel.supervisor.lose("closed by the test")
        down = f"prefill of {long_tokens} tokens in this process: the prefill group is down"
        assert route(LONG_PROMPT).startswith(down)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_for_slow_steps():
    stream = Terminal()
    with DelayedProgress("Loading", delay=0.05, stream=stream) as progress:
        time.sleep(0.2)
        progress.update(3, 4)
    assert "Loading:  75%" in stream.getvalue() and "3/4" in stream.getvalue()


def test_progress_is_silent_for_quick_steps():
    stream = Terminal()
    with DelayedProgress("Loading", delay=1.0, stream=stream) as progress:
        progress.update(1, 2)
    assert stream.getvalue() == ""


@pytest.mark.slow
def test_progress_draws_nothing_into_a_pipe():
    script = (
        "import time\nfrom kvserve.entrypoints.progress import DelayedProgress\n"
        "with DelayedProgress('Loading', delay=0.0) as p:\n"
        "    for i in range(5):\n        p.update(i, 5)\n        time.sleep(0.1)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.real_model
def test_generate_on_the_default_model_shows_text_then_summary(default_model):
    prompt = "The capital of France is"
    result = generate("--dtype", "float32", "--threads", "1", "--max-tokens", "8", prompt, merged=True)
    assert result.returncode == 0, result.stdout
    before, echoed, after = result.stdout.partition(prompt)
    assert echoed and "INFO kvserve: loaded" in before
    first_log = LOG_LINE.search(after)
    text = after[: first_log.start()]
    assert "Paris" in text and text.endswith("\n")
    summary = summary_of(after[first_log.start() :])
    assert int(summary.group(1)) == len(default_model.tokenizer.encode(prompt))
    assert int(summary.group(5)) == 8 and float(summary.group(6)) > 0
    assert "\r" not in result.stdout and "\033[" not in result.stdout

"""Every shipped example runs as its README says (a subprocess, the default model, few tokens) and prints
what it promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def check_prompt_cache(stdout: str) -> None:
    """Each schema's layout, then per prompt: cached tokens, both TTFTs and a non-empty output."""
    folder = EXAMPLES / "prompt_cache"
    prompts = json.loads((folder / "prompts.json").read_text())
    assert len(re.findall(r"^schema '[\w-]+': \d+ positions$", stdout, re.M)) == len(prompts)
    blocks = re.findall(
        r"^--- (\S+): imports .+\n    (\d+) prompt tokens, (\d+) from cached modules\n"
        r"    TTFT with Prompt Cache: +([\d.]+) ms\n    TTFT, same tokens computed from scratch: +([\d.]+) ms .*\n"
        r"    output: (['\"])(.+)\6\n    plain output: .+$",
        stdout,
        re.M,
    )
    assert [b[0] for b in blocks] == [name for name, texts in prompts.items() for _ in texts], stdout
    for _, total, cached, with_cache, scratch, _, output in blocks:
        assert 0 < int(cached) < int(total)
        assert float(with_cache) > 0 and float(scratch) > 0 and output.strip()


# example folder -> (its README's command line, with small arguments; what its output must show)
COMMANDS = {
    "prompt_cache": (["prompt_cache/run.py", "--max-tokens", "4"], check_prompt_cache),
}


def test_every_example_is_run_here():
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) == sorted(COMMANDS)


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_example_runs(name: str):
    (script, *args), check = COMMANDS[name]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600, cwd=EXAMPLES
    )
    assert result.returncode == 0, result.stderr
    check(result.stdout)
    assert "\r" not in result.stderr  # no progress frames in a pipe

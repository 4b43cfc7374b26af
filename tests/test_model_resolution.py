"""``--model`` / ``LLM(model=...)`` values: Hugging Face names found offline in a (fake) Hugging Face cache, with
huggingface_hub and without it, the default model's names, and the error that says where kvserve looked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.errors import ModelLoadError
from kvserve.models.catalog import default_model_path, resolve_model_path
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture


def cached_repo(cache: Path, repo_id: str, revision: str = "abc") -> Path:
    """An empty snapshot of ``repo_id`` laid out as huggingface_hub lays it out; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture(params=["huggingface_hub", "refs"])
def lookup(request, monkeypatch) -> str:
    """Each test runs with huggingface_hub's offline lookup and with kvserve's own reading of refs/main."""
    if request.param == "refs":
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if it were not installed
    return request.param


def test_a_cached_hugging_face_name_loads_its_snapshot(hf_cache, lookup, tmp_path):
    snapshot = write_tiny_model(cached_repo(hf_cache, "org/tiny-llama"), TinySpec(seed=5))
    cached_repo(hf_cache, "org/other", revision="old")  # another model in the cache is not picked
    assert resolve_model_path("org/tiny-llama") == snapshot
    params = SamplingParams(max_tokens=5, temperature=0)
    with LLM("org/tiny-llama", dtype="float32", kv_cache_memory="1MiB", swap_space=0) as by_name:
        named = by_name.generate("the cat sat", params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(snapshot), dtype="float32", kv_cache_memory="1MiB", swap_space=0) as by_path:
        assert by_path.generate("the cat sat", params, use_tqdm=False)[0].outputs[0].token_ids == named


def test_the_revision_comes_from_refs_main(hf_cache, lookup):
    old = write_tiny_model(cached_repo(hf_cache, "org/tiny", revision="old"), TinySpec(seed=1))
    new = old.parent / "new"
    new.mkdir()
    (new / "config.json").write_text("{}")
    (old.parent.parent / "refs" / "main").write_text("new")
    assert resolve_model_path("org/tiny") == new


def test_a_missing_name_says_where_kvserve_looked(hf_cache, lookup, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path("org/not-here")
    message = str(info.value)
    assert f"{tmp_path / 'org' / 'not-here'} does not exist" in message
    assert str(hf_cache / "models--org--not-here") in message
    assert "hf download org/not-here" in message


def test_a_snapshot_without_a_model_is_a_clear_error(hf_cache, lookup):
    snapshot = cached_repo(hf_cache, "org/ggufs")
    with pytest.raises(ModelLoadError, match="has neither config.json nor a .gguf file"):
        resolve_model_path("org/ggufs")
    (snapshot / "a.Q4_0.gguf").write_bytes(b"")
    assert resolve_model_path("org/ggufs") == snapshot / "a.Q4_0.gguf"
    (snapshot / "b.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a.Q4_0.gguf, b.Q8_0.gguf\)"):
        resolve_model_path("org/ggufs")


def test_an_existing_path_wins_over_a_name(hf_cache, tmp_path, monkeypatch):
    cached_repo(hf_cache, "models/tiny")
    local = tmp_path / "models" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("models/tiny") == Path("models/tiny")


def test_the_default_model_names_fall_back_to_the_shipped_file(hf_cache, lookup):
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "smollm2-135m", None):
        assert resolve_model_path(name) == default_model_path()
    snapshot = write_tiny_model(cached_repo(hf_cache, "HuggingFaceTB/SmolLM2-135M-Instruct"), TinySpec())
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot  # the cached one first


def _run_generate(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "kvserve", "generate", "--threads", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_generate_with_a_missing_name_fails_in_one_line(hf_cache):
    result = _run_generate(hf_cache, "--model", "org/absent", "hi")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("kvserve: error: model 'org/absent' is neither a file or folder")
    assert str(hf_cache / "models--org--absent") in result.stderr


@pytest.mark.slow
@pytest.mark.real_model
def test_generate_loads_a_cached_gguf_repo_by_name(hf_cache):
    snapshot = cached_repo(hf_cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF")
    (snapshot / "smollm2-135m-instruct-q4_1.gguf").symlink_to(default_model_path())  # as the hub links blobs
    result = _run_generate(hf_cache, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--max-tokens", "8",
                           "The capital of France is")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "smollm2-135m-instruct-q4_1.gguf" in result.stderr  # the load log names the file it found

"""The KV offloading / InfiniGen options on the ``kvserve`` commands, run in-process on a tiny checkpoint.

- ``generate``: offloading to disk with InfiniGen selecting every row, and to the host tier fetching
  everything, print exactly the plain continuation (an offloading engine ran and fetched from its tier;
  the disk folder is left empty); default InfiniGen runs too; bad flag combinations exit 2 with a
  message naming the problem, before anything is printed (also on ``eval``).
- ``infinigen-setup``: writes one skewing file (orthogonal matrices) where ``--output`` or
  ``$KVSERVE_INFINIGEN_DIR`` says, reuses it on a second run (same mtime) and rewrites it with ``--refresh``.
- ``bench offload``: writes the .json/.md/.png report, one cell per (tier, offloaded policy, context,
  batch) plus H2O's once; InfiniGen moves fewer bytes per token than fetch-everything, and INT4's
  share of fetch-everything's bytes is the ratio of their tier block sizes.
- ``eval ppl`` offloaded with InfiniGen: a finite perplexity over the same tokens; InfiniGen selecting
  every row scores as the plain engine does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import kvserve.core.engine
from kvserve.attention.offloaded import OffloadedKVCache, offload_block_bytes
from kvserve.entrypoints.cli import main
from kvserve.policies import make_policy
from kvserve.policies.skewing import SKEWING_DIR_ENV
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

# head_dim 64: INT4's default group of 64 values per row.
SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=4, head_dim=64, max_position_embeddings=512, seed=5)
PROMPT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat"
EVERYTHING = ["--infinigen-alpha", "1e9", "--infinigen-partial-ratio", "1"]  # InfiniGen selecting every row
COMMON = ["--dtype", "float32", "--threads", "1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("offload-cli"), SPEC))


@pytest.fixture(autouse=True)
def skewing_dir(tmp_path, monkeypatch) -> Path:
    """Every test computes InfiniGen's skewing into its own temporary folder, never ~/.cache (and leaves
    kvserve's logger alone: a handler made here would keep this test's closed capture stream)."""
    folder = tmp_path / "skewing-env"
    monkeypatch.setenv(SKEWING_DIR_ENV, str(folder))
    monkeypatch.setenv("KVSERVE_CONFIGURE_LOGGING", "0")
    return folder


@pytest.fixture
def engines(monkeypatch) -> list[kvserve.core.engine.LLMEngine]:
    """Every ``LLMEngine`` the commands build (they import it from ``kvserve.core.engine`` when they run)."""
    built = []

    class Recorded(kvserve.core.engine.LLMEngine):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - LLMEngine's
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(kvserve.core.engine, "LLMEngine", Recorded)
    return built


def generate(model: str, capsys, *flags: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``kvserve generate PROMPT`` with ``flags``."""
    capsys.readouterr()
    status = main(["generate", PROMPT, "--model", model, "--max-tokens", "5", *COMMON, *flags])
    out, err = capsys.readouterr()
    return status, out, err


def offloading_cache(engines: list) -> OffloadedKVCache:
    """The cache of the one engine built since the last call (which forgets it)."""
    (engine,) = engines
    engines.clear()
    assert isinstance(engine.runner.cache, OffloadedKVCache)
    return engine.runner.cache


def test_generate_offloaded_prints_the_plain_continuation(model, tmp_path, capsys, engines) -> None:
    status, plain, err = generate(model, capsys)
    assert status == 0 and plain.startswith(PROMPT) and len(plain) > len(PROMPT) + 1
    assert engines == []  # the plain path runs no engine

    disk = tmp_path / "disk"
    disk.mkdir()
    status, out, err = generate(model, capsys, "--kv-offload", "disk", "--kv-offload-path", str(disk),
                                "--kv-policy", "infinigen", *EVERYTHING)  # fmt: skip
    assert status == 0, err
    assert out == plain
    cache = offloading_cache(engines)
    assert cache.tier.kind == "disk" and cache.rehearsal.partial_dims == SPEC.head_dim
    assert cache.queue.stats.bytes_fetched > 0 and cache.stats.fetch_fraction() == [1.0] * SPEC.num_layers
    assert list(disk.iterdir()) == []  # the mapped file is unlinked at once

    status, out, err = generate(model, capsys, "--kv-offload", "host")  # fetch-everything, the default policy
    assert status == 0, err
    assert out == plain
    cache = offloading_cache(engines)
    assert cache.tier.kind == "host" and cache.rehearsal is None and cache.queue.stats.bytes_fetched > 0

    # InfiniGen's default selection over the disk tier runs too (its continuation may differ).
    status, out, err = generate(model, capsys, "--kv-offload", "disk", "--kv-offload-path", str(disk),
                                "--kv-policy", "infinigen")  # fmt: skip
    assert status == 0, err
    assert out.startswith(PROMPT) and len(out) > len(PROMPT) + 1
    cache = offloading_cache(engines)
    assert cache.tier.kind == "disk" and cache.rehearsal.partial_dims == math.ceil(0.3 * SPEC.head_dim)


BAD_FLAGS = [
    pytest.param(
        ["--kv-policy", "int4"],
        "kv_policy='int4' fetches from an offloaded cache: set kv_offload to 'host' or 'disk'",
        id="int4-without-offload",
    ),
    pytest.param(
        ["--kv-offload", "host", "--kv-policy", "infinigen", "--kv-pool-limit", "0"],
        "kv_pool_limit must be in (0, 1], got 0.0",
        id="pool-limit-0",
    ),
    pytest.param(["--kv-pool-limit", "0.5"], "kv_pool_limit=0.5 limits an offloaded cache", id="pool-limit-no-offload"),
    pytest.param(
        ["--kv-offload", "host", "--kv-pool-limit", "0.5"],
        "kv_pool_limit evicts by InfiniGen's selection counts: it needs kv_policy='infinigen', got 'full'",
        id="pool-limit-full",
    ),
    pytest.param(
        ["--kv-offload", "host", "--kv-policy", "h2o", "--kv-pool-limit", "0.5"],
        "kv_pool_limit evicts by InfiniGen's selection counts: it needs kv_policy='infinigen', got 'h2o'",
        id="pool-limit-h2o",
    ),
    pytest.param(
        ["--kv-offload-path", "."],
        "kv_offload_path is the disk tier's folder; kv_offload is 'none'",
        id="path-without-disk",
    ),
    pytest.param(
        ["--kv-offload", "host", "--kv-policy", "infinigen", "--infinigen-alpha", "-1"],
        "infinigen_alpha must be 'auto' or a finite number >= 0 (or one per layer), got -1.0",
        id="alpha-negative",
    ),
    pytest.param(
        ["--kv-offload", "host", "--kv-policy", "infinigen", "--infinigen-partial-ratio", "0"],
        "infinigen_partial_ratio must be in (0, 1], got 0.0",
        id="ratio-0",
    ),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS)
def test_generate_rejects_bad_offload_flags_before_printing(model, capsys, engines, flags, message) -> None:
    status, out, err = generate(model, capsys, *flags)
    assert status == 2
    assert f"kvserve: error: {message}" in err, err
    assert out == "" and engines == []  # validated before the prompt is echoed or an engine is built


def test_bad_offload_flags_are_errors_on_the_other_commands(model, tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(PROMPT)
    missing = tmp_path / "missing"
    assert main(["eval", "ppl", "--model", model, "--data", str(text), *COMMON, "--kv-policy", "int4"]) == 2
    assert "set kv_offload to 'host' or 'disk'" in capsys.readouterr().err
    argv = ["eval", "ppl", "--model", model, "--data", str(text), *COMMON, "--kv-offload", "disk"]
    assert main([*argv, "--kv-offload-path", str(missing)]) == 2
    assert f"kv_offload_path {str(missing)!r} is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse: not one of the choices
        main(["generate", PROMPT, "--model", model, "--kv-offload", "gpu"])
    assert exit_.value.code == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def run_setup(model: str, capsys, *flags: str) -> Path:
    """Run ``kvserve infinigen-setup``; the skewing file it names."""
    capsys.readouterr()
    assert main(["infinigen-setup", "--model", model, *COMMON, *flags]) == 0
    out = capsys.readouterr().out
    assert out.startswith("infinigen-setup: ") and out.rstrip().endswith(".pt"), out
    assert f"skewing for {SPEC.num_layers} layers x {SPEC.num_kv_heads} KV heads (head dim {SPEC.head_dim})" in out
    return Path(out.rstrip().rsplit(" in ", 1)[1])


def test_infinigen_setup_caches_reuses_and_refreshes_its_file(model, tmp_path, skewing_dir, capsys) -> None:
    output = tmp_path / "skewing"
    file = run_setup(model, capsys, "--output", str(output))
    assert list(output.iterdir()) == [file]
    saved = torch.load(file, weights_only=True)
    matrices = saved["matrices"]
    assert matrices.shape == (SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, SPEC.head_dim)
    identity = torch.eye(SPEC.head_dim).expand_as(matrices)
    torch.testing.assert_close(matrices.transpose(-1, -2) @ matrices, identity, atol=1e-4, rtol=0)  # orthogonal
    first = file.stat().st_mtime_ns

    assert run_setup(model, capsys, "--output", str(output)) == file
    assert file.stat().st_mtime_ns == first  # reused, not rewritten
    assert list(output.iterdir()) == [file]

    assert run_setup(model, capsys, "--output", str(output), "--refresh") == file
    assert file.stat().st_mtime_ns != first  # rewritten, with the same (deterministic) matrices
    assert list(output.iterdir()) == [file]
    torch.testing.assert_close(torch.load(file, weights_only=True)["matrices"], matrices, atol=0, rtol=0)

    # Without --output the file goes to $KVSERVE_INFINIGEN_DIR, under the same name.
    assert not skewing_dir.exists()
    default = run_setup(model, capsys)
    assert default == skewing_dir / file.name and list(skewing_dir.iterdir()) == [default]


def test_infinigen_setup_calibrates_alpha_auto_as_asked(model, tmp_path, capsys) -> None:
    output = tmp_path / "skewing"
    capsys.readouterr()
    flags = ["--output", str(output), "--partial-ratio", "1", "--calibration-mass", "0.8"]
    file = run_setup(model, capsys, *flags, "--calibration-quantile", "0.5", "--calibration-window-mass", "0.85")
    calibration = torch.load(file, weights_only=True)["calibration"]
    assert (calibration["mass"], calibration["quantile"], calibration["window_mass"]) == (0.8, 0.5, 0.85)
    assert set(calibration["alphas"]) == {20, SPEC.head_dim}  # the default ratio's and the one asked for
    assert len(calibration["alphas"][SPEC.head_dim]) == SPEC.num_layers
    assert main(["infinigen-setup", "--model", model, *COMMON, "--calibration-mass", "0"]) == 2
    assert "infinigen calibration mass must be in (0, 1], got 0.0" in capsys.readouterr().err
    assert main(["infinigen-setup", "--model", model, *COMMON, "--calibration-window-mass", "1.5"]) == 2
    assert "infinigen calibration window_mass must be in (0, 1], got 1.5" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_offload_writes_a_consistent_report(model, tmp_path, capsys) -> None:
    out, disk = tmp_path / "x", tmp_path / "disk"
    disk.mkdir()
    argv = ["bench", "offload", "--model", model, *COMMON, "--contexts", "64,128", "--batches", "2,1"]
    argv += ["--steps", "2", "--tiers", "host,disk", "--kv-cache-memory", "64MiB", "--kv-offload-path", str(disk)]
    assert main([*argv, "--output", str(out)]) == 0
    assert list(disk.iterdir()) == []
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["policies"] == ["full", "infinigen", "int4", "h2o"]
    cells = {(c["tier"], c["policy"], c["context"], c["batch"]): c for c in report["results"]}
    offloaded = {(t, p, c, b) for t in ("host", "disk") for p in ("full", "infinigen", "int4")
                 for c in (64, 128) for b in (2, 1)}  # fmt: skip
    h2o = {("memory", "h2o", c, b) for c in (64, 128) for b in (2, 1)}
    assert len(report["results"]) == len(cells) == len(offloaded) + len(h2o)
    assert set(cells) == offloaded | h2o
    for cell in report["results"]:
        assert cell["steps"] == 2 and math.isfinite(cell["ms_per_step"]) and cell["ms_per_step"] > 0, cell
        assert cell["bytes_per_token"] > 0, cell

    # The slower tier's block of 16 tokens under each policy (float32 model).
    block = {
        name: offload_block_bytes(
            make_policy(name), SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, torch.float32, 16
        )
        for name in ("full", "int4")
    }
    assert block["int4"] < block["full"]
    for tier, _, context, batch in offloaded:
        full = cells[(tier, "full", context, batch)]["bytes_per_token"]
        assert cells[(tier, "infinigen", context, batch)]["bytes_per_token"] < full
        int4 = cells[(tier, "int4", context, batch)]["bytes_per_token"]
        assert int4 / full == pytest.approx(block["int4"] / block["full"], rel=1e-9)

    markdown = out.with_suffix(".md").read_text()
    assert "## KV in the host tier" in markdown and "## KV in the disk tier" in markdown
    assert "| 128 | 2 |" in markdown
    assert out.with_suffix(".png").stat().st_size > 1000


def perplexity(model: str, text: Path, output: Path, *flags: str) -> dict:
    argv = ["eval", "ppl", "--model", model, "--data", str(text), "--context", "64", "--stride", "32", *COMMON]
    assert main([*argv, "--swap-space", "0", "--kv-cache-memory", "16MiB", "--output", str(output), *flags]) == 0
    return json.loads(output.read_text())


def test_eval_ppl_offloaded_with_infinigen(model, tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(f"{PROMPT}. " * 12)
    plain = perplexity(model, text, tmp_path / "plain.json")
    capsys.readouterr()
    report = perplexity(model, text, tmp_path / "infinigen.json", "--kv-offload", "host", "--kv-policy", "infinigen")
    out = capsys.readouterr().out
    results = report["results"]
    assert math.isfinite(results["perplexity"]) and results["perplexity"] > 1
    assert f"perplexity {results['perplexity']:.3f} over {results['scored_tokens']:,} tokens" in out
    assert results["scored_tokens"] == plain["results"]["scored_tokens"] and results["num_windows"] > 1
    assert report["engine"]["kv_offload"] == "host" and report["engine"]["kv_policy"] == "infinigen"
    assert results["perplexity"] != plain["results"]["perplexity"]  # the selection ran in the prompts' chunks
    everything = perplexity(
        model, text, tmp_path / "everything.json", "--kv-offload", "host", "--kv-policy", "infinigen", *EVERYTHING
    )
    assert everything["results"]["perplexity"] == pytest.approx(plain["results"]["perplexity"], rel=1e-5)


def test_eval_ppl_infinigen_on_the_device_is_the_offloaded_one(model, tmp_path) -> None:
    """Without --kv-offload, InfiniGen's scored chunks select as the offloaded cache's: the same perplexity."""
    text = tmp_path / "text.txt"
    text.write_text(f"{PROMPT}. " * 12)
    offloaded = perplexity(model, text, tmp_path / "offloaded.json", "--kv-offload", "host", "--kv-policy", "infinigen")
    device = perplexity(model, text, tmp_path / "device.json", "--kv-policy", "infinigen")
    plain = perplexity(model, text, tmp_path / "plain.json")
    assert device["engine"]["kv_offload"] == "none"
    assert device["results"]["perplexity"] == pytest.approx(offloaded["results"]["perplexity"], rel=1e-5)
    assert device["results"]["perplexity"] != plain["results"]["perplexity"]


@pytest.mark.slow
def test_bench_offload_device_tier_is_sparse_decode_by_context(model, tmp_path) -> None:
    out = tmp_path / "sd"
    argv = ["bench", "offload", "--model", model, *COMMON, "--contexts", "64,128", "--steps", "2", "--tiers", "device"]
    assert main([*argv, "--kv-cache-memory", "16MiB", "--output", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["benchmark"] == "sparse-decode" and [c["context"] for c in report["results"]] == [64, 128]
    for cell in report["results"]:
        assert cell["steps"] == 2 and cell["full_ms"] > 0 and cell["sparse_ms"] > 0 and 0 < cell["read_fraction"] <= 1
    assert "| 128 |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000

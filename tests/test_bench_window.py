"""``kvserve bench window`` on a tiny random Gemma-3-like checkpoint (window 8): the report's structure, and
window KV groups holding fewer bytes per sequence, and running more sequences in one KV memory, than
every layer kept full. No timings are asserted."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.bench import window
from kvserve.entrypoints.cli import main
from kvserve.models import load_model
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401

WINDOW = 8
# 6 layers, every sixth global: one global layer and five window layers, each a one-layer KV group.
SPEC = TinySpec(
    arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True,
    extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
)  # fmt: skip
# A 64-token context is eight windows; 32-token sequences in 96 KiB: every layer full holds two of them.
TINY_ARGS = [
    "--dtype", "float32", "--threads", "1", "--block-size", "4", "--context", "64", "--context-new-tokens", "4",
    "--prefill-chunk", "16", "--seq-tokens", "32", "--max-tokens", "4", "--kv-cache-memory", "96KiB",
    "--max-num-batched-tokens", "64", "--max-sequences", "12",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), SPEC)


@pytest.fixture(scope="module")
def report(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "window"
    assert main(["bench", "window", "--model", str(tiny_model), *TINY_ARGS, "--output", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| **full / window groups** |" in out.with_suffix(".md").read_text()
    return json.loads(out.with_suffix(".json").read_text())


def test_report_structure(report):
    assert report["benchmark"] == "window" and report["dtype"] == "float32" and report["threads"] == 1
    assert report["machine"]["cpu"] in report["cpu"]
    window_run, full_run = report["results"]["configurations"]
    assert (window_run["kv_window_groups"], full_run["kv_window_groups"]) == (True, False)
    for run in (window_run, full_run):
        seq, conc = run["sequence"], run["concurrency"]
        assert (seq["prompt_tokens"], seq["new_tokens"], seq["decode_steps"]) == (60, 4, 3)
        assert conc["prompt_tokens"] == 28 and conc["max_tokens"] == 4
        assert conc["output_tokens"] == conc["num_requests"] * 4  # every request ran to its length
        assert 1 <= conc["peak_running"] <= conc["num_requests"] <= 12
        assert 0 < conc["peak_kv_bytes"] <= conc["kv_pool_bytes"]
    assert window_run["concurrency"]["num_requests"] == full_run["concurrency"]["num_requests"]


def test_window_groups_hold_less_and_run_more(report):
    """At eight windows of context the window layers keep about one window: the sequence holds well under
    the full cache, which every-layer-full holds exactly (whole blocks); more sequences then fit at once."""
    window_run, full_run = report["results"]["configurations"]
    analytic = report["results"]["analytic_bytes"]
    ws, fs = window_run["sequence"], full_run["sequence"]
    assert fs["decode_bytes"] == analytic["full"]  # 64 tokens, 16 blocks of 4, every layer
    assert ws["decode_bytes"] < 0.6 * fs["decode_bytes"]
    assert analytic["windows"] <= ws["decode_bytes"]  # blocks round up, never below the analytic count
    assert ws["prefill_peak_bytes"] < fs["prefill_peak_bytes"]  # a window group holds the window and one chunk
    assert window_run["concurrency"]["peak_running"] > full_run["concurrency"]["peak_running"]


def test_analytic_bytes_and_refusal_without_windows(tiny_model, tmp_path):
    loaded = load_model(tiny_model, dtype=torch.float32)
    per_token_layer = 2 * 2 * 16 * 4  # keys and values, 2 KV heads of 16, float32
    assert window.analytic_kv_bytes(loaded.config, 64, 4) == {
        "full": 6 * 64 * per_token_layer,
        "windows": (64 + 5 * WINDOW) * per_token_layer,
    }
    llama = load_model(write_tiny_model(tmp_path / "llama", TinySpec(num_kv_heads=2)), dtype=torch.float32)
    with pytest.raises(ValueError, match="no sliding-window layer"):
        window.run(llama, window.WindowBench(), print)

"""``kvserve bench speed``: the measurement arithmetic, the roofline inputs, and a real end-to-end run.

llama.cpp itself is not installed with the test extras; its worker is exercised by the benchmark
run recorded in benchmarks/speed/. Here the peer path is checked through the table and the error a
missing ``llama_cpp`` gives.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from kvserve.bench import speed
from kvserve.bench.cli import _speed_table
from kvserve.bench.plots import plot_speed_ratios
from kvserve.models.catalog import default_model_path
from kvserve.models.config import ModelConfig
from tests.real_models import shared_load


class FakeEngine:
    """Takes ``a + b * tokens`` seconds for any request, so the decode rate must come out as 1 / b."""

    name = "fake"
    load_s = 0.5
    decode_bytes_per_token = 1000

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b

    def generate(self, ids, new_tokens: int) -> float:
        return self.a + len(ids) * 1e-4 + self.b * new_tokens

    def decode(self, ids, new_tokens: int) -> float:
        return self.b * (new_tokens - 1)  # the steps after the first token

    def batch(self, prompts, new_tokens: int) -> float:
        return self.a + self.b * new_tokens  # all sequences in parallel

    def close(self) -> None:
        pass


def test_measure_derives_rates_from_engine_times() -> None:
    ids = list(range(100))
    prompts = [ids[:10]] * 8
    result = speed.measure(FakeEngine(0.2, 0.01), ids, [50, 100], 64, prompts, [2, 8], 16, 3, lambda _: None, [80])
    assert result.prefill_s == pytest.approx({50: 0.2 + 0.005 + 0.01, 100: 0.2 + 0.01 + 0.01})
    assert result.decode_tokens_per_s == pytest.approx(100.0)  # the decode steps alone: no constant, no prompt
    assert result.long_decode_tokens_per_s == pytest.approx({80: 100.0})
    assert result.batch_tokens_per_s == pytest.approx({2: 2 * 16 / 0.36, 8: 8 * 16 / 0.36})
    assert (result.load_s, result.decode_bytes_per_token) == (0.5, 1000)


class FakeWorker(FakeEngine):
    """A worker-process engine: the batch's first tokens after ``a`` seconds, and a peak resident set."""

    def batch_phases(self, prompts, new_tokens: int) -> tuple[float, float]:
        return self.batch(prompts, new_tokens), self.a

    def peak_rss_bytes(self) -> int:
        return 3 * 2**30


def test_measure_times_a_batch_decode_apart_and_reads_the_peak_rss() -> None:
    ids = list(range(100))
    result = speed.measure(FakeWorker(0.2, 0.01), ids, [50], 8, [ids[:10]] * 8, [8], 16, 2, lambda _: None)
    assert result.batch_tokens_per_s == pytest.approx({8: 8 * 16 / 0.36})
    assert result.batch_decode_tokens_per_s == pytest.approx({8: 8 * 15 / 0.16})  # the steps after the first token
    assert result.peak_rss_bytes == 3 * 2**30
    plain = speed.measure(FakeEngine(0.2, 0.01), ids, [50], 8, [ids[:10]] * 8, [8], 16, 2, lambda _: None)
    assert plain.batch_decode_tokens_per_s == {} and plain.peak_rss_bytes is None


def test_kv_memory_for_tokens_holds_that_many_tokens_in_whole_blocks() -> None:
    config = ModelConfig(
        architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    )  # fmt: skip
    per_token = 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 head of 4, bfloat16
    assert speed.kv_memory_for_tokens(config, 2048, torch.bfloat16) == 2048 * per_token
    assert speed.kv_memory_for_tokens(config, 2047, torch.bfloat16) == 2048 * per_token  # whole 16-token blocks
    assert speed.kv_memory_for_tokens(config, 2048, torch.float32, "bfloat16") == 2048 * per_token


def test_short_output_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="produced 3 tokens, expected 4"):
        speed._check_lengths("x", [[1, 2, 3, 4], [1, 2, 3]], 4)


def test_prefill_flops_counts_projections_attention_and_one_head_row() -> None:
    config = ModelConfig(
        architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    )  # fmt: skip
    # Per token and layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16 = 64+64+64+384 = 576 MACs.
    n = 3
    projections = 2 * n * 576 * 2
    attention = 2 * 2 * (1 + 2 + 3) * 2 * 4 * 2  # QK^T and PV over 1 + 2 + 3 causal keys, 2 heads of 4, 2 layers
    assert speed.prefill_flops(config, n) == projections + attention + 2 * 100 * 8


def test_decode_bytes_native_reads_the_compact_weights(default_model) -> None:
    dequant = shared_load(dtype=torch.bfloat16, weights="dequant")
    params = sum(p.numel() for p in dequant.model.parameters())  # the tied embedding counts once: it is the head
    assert speed.decode_weight_bytes(dequant.model) == 2 * params
    native = shared_load(dtype=torch.bfloat16, weights="native")
    native_bytes = speed.decode_weight_bytes(native.model)
    # int4 codes (half a byte) + a bfloat16 scale and zero per 32 weights; the Q8_0 head as two such planes.
    assert 0.3 * 2 * params < native_bytes < 0.45 * 2 * params
    # float32: int4 codes + a float32 scale and offset per 32 weights; the Q8_0 head as its 8-bit codes.
    native32 = speed.decode_weight_bytes(default_model.model)
    assert 0.15 * 4 * params < native32 < 0.25 * 4 * params, native32 / (4 * params)
    file_bytes = speed.gguf_decode_bytes(default_model_path())
    assert 0.9 * default_model_path().stat().st_size < file_bytes < default_model_path().stat().st_size


def test_llamacpp_interpreter_is_found_or_named_in_the_error(tmp_path) -> None:
    if importlib.util.find_spec("llama_cpp") is not None:
        assert speed.find_llamacpp_python(None) == sys.executable
    else:
        with pytest.raises(RuntimeError, match="pip install llama-cpp-python"):
            speed.find_llamacpp_python(None)
    python_without_it = tmp_path / "python"
    python_without_it.write_text("#!/bin/sh\nexit 1\n")
    python_without_it.chmod(0o755)
    with pytest.raises(RuntimeError, match=f"no llama_cpp module for {python_without_it}"):
        speed.find_llamacpp_python(str(python_without_it))


def test_table_and_plot_show_ratios_against_each_peer(tmp_path) -> None:
    def result(engine: str, scale: float) -> dict:
        return {
            "engine": engine, "load_s": 1.0, "prefill_s": {512: 0.2 * scale, 2048: 1.0 * scale},
            "decode_tokens_per_s": 50 / scale, "batch_tokens_per_s": {8: 100 / scale, 32: 300 / scale},
            "long_decode_tokens_per_s": {4096: 20 / scale},
            "decode_bytes_per_token": 100e6,
        }  # fmt: skip

    report = {
        "model": "m.gguf", "command": "kvserve bench speed", "date": "2026-11-22", "threads": 2, "dtype": "bfloat16",
        "weights": "native", "machine": {"cpu": "cpu", "nproc": 2, "memory_gib": 1, "torch": "2.13"},
        "peers": {"llama.cpp": {"version": "0.3", "settings": "use_extra_bufts=False, flash attention off"}},
        "roofline": {"copy_gb_per_s": 20.0, "matmul_gflop_per_s": 2000.0, "matmul_dtype": "float32"},
        "prefill_gflop": {512: 100.0, 2048: 500.0},
        "workload": {"decode_tokens": 128, "batch_prompt_tokens": 64, "batch_new_tokens": 128},
        "results": [result("kvserve", 1.0), result("llama.cpp", 4.0)],
    }  # fmt: skip
    table = _speed_table(report)
    assert "| decode b=1 after 4096 (tok/s) |" in table
    assert "| **kvserve / llama.cpp** |  | 4.00x | 4.00x | 4.00x | 4.00x | 4.00x | 4.00x |" in table
    # decode: 100 MB x 50 tok/s / 20 GB/s; prefill 512: 100 GFLOP / 0.2 s / 2 TFLOP/s (2048: 500 / 1.0 / 2)
    assert "| kvserve | 100.0 | 25% | 25% | 25% |" in table
    assert "float32 matmul 2,000 GFLOP/s" in table and "/ float32 peak" in table
    # A report from before the roofline followed the run's dtype: its bfloat16 rate, named so.
    legacy = _speed_table({**report, "roofline": {"copy_gb_per_s": 20.0, "bf16_gflop_per_s": 2000.0}})
    assert "bfloat16 matmul 2,000 GFLOP/s" in legacy and "| kvserve | 100.0 | 25% | 25% | 25% |" in legacy
    plot_speed_ratios(report, tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").stat().st_size > 1000
    assert "peak RSS" not in table  # a report without them has no rates-and-memory table
    ours, peer = report["results"]
    ours |= {"peak_rss_bytes": 2 * 2**30, "batch_decode_tokens_per_s": {32: 400.0}}
    peer |= {"peak_rss_bytes": 2**30, "batch_decode_tokens_per_s": {32: 200.0}}
    report["kv_memory"] = {"kvserve": "KV cache: 128 blocks", "llama.cpp": "n_ctx 2048 (one pool)"}
    table = _speed_table(report)
    assert "| engine | load (s) | prefill 512 (tok/s) | prefill 2048 (tok/s) | decode b=1 (tok/s) |" in table
    assert "| kvserve | 1.00 | 2560 | 2048 | 50.0 | 400.0 | 2.00 | 25% |" in table
    assert "| **kvserve / llama.cpp** | 1.00x | 4.00x | 4.00x | 4.00x | 2.00x | 2.00x | 4.00x |" in table
    assert "KV memory: kvserve: KV cache: 128 blocks; llama.cpp: n_ctx 2048 (one pool)." in table


@pytest.mark.real_model
def test_bench_speed_runs_kvserve_and_transformers_end_to_end(tmp_path) -> None:
    out = tmp_path / "speed"
    result = subprocess.run(
        [
            sys.executable, "-m", "kvserve", "bench", "speed", "--peers", "transformers", "--threads", "2",
            "--prefill-lengths", "32,64", "--decode-tokens", "4", "--batch-sizes", "2,3", "--batch-prompt-tokens", "16",
            "--batch-new-tokens", "4", "--long-decode-contexts", "80", "--repeats", "1", "--output", str(out),
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    kvserve, transformers = report["results"]
    assert transformers["engine"] == "transformers" and report["device"] == "cpu"
    # Every row on both engines; decode timed from the first token (the transformers streamer's clock).
    assert transformers["decode_tokens_per_s"] > 0 and transformers["long_decode_tokens_per_s"]["80"] > 0
    # dtype auto, bfloat16 or float32: the Q4 weights run on their codes ("native").
    assert kvserve["engine"] == "kvserve (native)"
    assert set(kvserve["prefill_s"]) == {"32", "64"} and set(kvserve["batch_tokens_per_s"]) == {"2", "3"}
    assert kvserve["decode_tokens_per_s"] > 0 and kvserve["prefill_s"]["64"] > 0
    assert kvserve["long_decode_tokens_per_s"]["80"] > 0
    assert report["roofline"]["copy_gb_per_s"] > 0 and report["roofline"]["matmul_gflop_per_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# CPU speed") and "| kvserve (native) |" in table and "| transformers |" in table


def test_bench_speed_rejects_unknown_peers_and_non_gguf_models(tmp_path, capsys) -> None:
    from kvserve.entrypoints.cli import main

    assert main(["bench", "speed", "--peers", "vllm"]) == 2
    assert "unknown peer(s) ['vllm']" in capsys.readouterr().err
    assert main(["bench", "speed", "--peers", "", "--model", str(tmp_path)]) == 2
    assert "not a .gguf file" in capsys.readouterr().err


def test_an_output_name_with_a_dot_is_refused_not_cut_short() -> None:
    import argparse

    from kvserve.bench.results_dir import output_path

    with pytest.raises(ValueError, match=r"would be llama3\.json and llama3\.md"):
        output_path(argparse.Namespace(output="out/llama3.2-1b"), "speed")
    assert str(output_path(argparse.Namespace(output="out/speed.json"), "speed")) == "out/speed.json"
    assert str(output_path(argparse.Namespace(output="out/llama32-1b"), "speed")) == "out/llama32-1b"

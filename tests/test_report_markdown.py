"""Every bench and eval Markdown writer, fed a small report with long floats, lists and dicts, prints tables
and words: no Python repr (a dict, a list, a 15-digit float) reaches the Markdown."""

from __future__ import annotations

import re

import pytest

from kvserve.bench import compression, offload, prefix, prompt_cache, serve, soak, window
from kvserve.bench.cli import _markdown_table, _prefill_table, _speed_table, _throughput_table
from kvserve.eval.compare import compare_table
from tests.eval.test_compare import _mc

RAW_REPR = re.compile(r"\{'|\{\"|\{\d|\['|\[\d|\[\]|\d\.\d{7,}| object at 0x")
X = 0.123456789012345  # a value a writer must round
MACHINE = {"cpu": "Test CPU", "nproc": 2, "memory_gib": 15.6, "python": "3.11.7", "torch": "2.13.0+cpu",
           "torch_threads": 2, "cpu_capability": "AVX512"}  # fmt: skip
HEAD = {"model": "m.gguf", "dtype": "bfloat16", "weights": "native", "threads": 2, "date": "2026-11-24",
        "command": "kvserve bench x", "machine": MACHINE}  # fmt: skip


def latency() -> str:
    result = {"engine": "kvserve", "load_s": 1 + X, "prefill_s": {512: X, 2048: 4 * X}, "decode_tokens_per_s": 30 + X}
    return _markdown_table({**HEAD, "results": [result, {**result, "engine": "transformers"}]})


def speed() -> str:
    result = {"engine": "kvserve", "load_s": 1 + X, "prefill_s": {512: X}, "decode_tokens_per_s": 30 + X,
              "batch_tokens_per_s": {8: 90 + X}, "decode_bytes_per_token": 1e8 + X}  # fmt: skip
    return _speed_table({
        **HEAD, "peers": {"llama.cpp": {"version": "0.3.16", "settings": "flash attention off"}},
        "roofline": {"copy_gb_per_s": 20 + X, "bf16_gflop_per_s": 900 + X}, "prefill_gflop": {512: 70 + X},
        "workload": {"decode_tokens": 8, "batch_prompt_tokens": 64, "batch_new_tokens": 16},
        "results": [result, {**result, "engine": "llama.cpp"}],
    })  # fmt: skip


def prefill() -> str:
    lengths = {1000: X, 2000: 2 * X}
    return _prefill_table({
        **HEAD, "prefill_parallel": 2,
        "results": {
            "ttft_s": {"single": lengths, "KVR-S": lengths, "TSP": lengths}, "bound_s": lengths,
            "partitions": {"KVR-E": {1000: [500, 500], 2000: [1000, 1000]},
                           "KVR-S": {1000: [384, 616], 2000: [1120, 880]}},
        },
    })  # fmt: skip


def throughput() -> str:
    result = {"engine": "kvserve", "seconds": 10 + X, "requests_per_s": X, "output_tokens_per_s": 50 + X,
              "kv_waste_pct": X}  # fmt: skip
    return _throughput_table({
        **HEAD, "decode_tokens": 32, "results": [result, {**result, "engine": "transformers"}],
        "workload": {"trace": "azure.csv", "num_requests": 4, "scale": 4.0, "prompt_tokens": 900, "output_tokens": 80,
                     "hf_batch_size": 8},
        "decode_scaling_tokens_per_s": {"kvserve": {1: 10 + X, 4: 30 + X}, "transformers": {1: 9 + X, 4: 20 + X}},
    })  # fmt: skip


def prefix_table() -> str:
    result = {"prefix_caching": True, "seconds": 9 + X, "mean_ttft_s": X, "p50_ttft_s": X, "max_ttft_s": 2 * X,
              "prefix_hit_rate": X, "cached_tokens_per_request": 1400 + X, "prompt_tokens": 48000}  # fmt: skip
    workload = {"num_requests": 32, "shared_tokens": 1500, "max_tokens": 16}
    return prefix.markdown({**HEAD, "workload": workload, "results": [result, {**result, "prefix_caching": False}]})


def compression_table() -> str:
    result = {"policy": "full", "budget": 1.0, "kv_bytes_per_seq": 3e7 + X, "prefill_reserved_bytes_per_seq": 4e7 + X,
              "peak_running": 9, "preemptions": 2, "output_tokens_per_s": 40 + X,
              "decode_tokens_per_s": 50 + X, "seconds": 60 + X, "decode_seconds": 20 + X}  # fmt: skip
    report = {**HEAD, "kv_cache_memory": "400MiB", "workload": "32 requests", "results": [result, {**result,
              "policy": "pyramid", "budget": 0.5}]}  # fmt: skip
    return compression.markdown(report)


def offload_table() -> str:
    cell = {"tier": "host", "policy": "full", "context": 2048, "batch": 1, "ms_per_step": 30 + X,
            "bytes_per_token": 1e6 + X, "steps": 8}  # fmt: skip
    cells = [cell, {**cell, "policy": "infinigen"}, {**cell, "tier": "memory", "policy": "h2o"}]
    return offload.markdown({**HEAD, "note": "Prompts: Austen.", "policies": ["full", "infinigen", "h2o"],
                             "results": cells})  # fmt: skip


def prompt_cache_table() -> str:
    row = {"target_tokens": 1024, "document_tokens": 1020, "method": "no cache", "median_ttft_s": 1 + X,
           "computed_tokens": 1030 + X, "setup_s": X, "bytes_per_cached_token": None}  # fmt: skip
    rows = [row, {**row, "method": "prompt cache (device)", "bytes_per_cached_token": 18432 + X}]
    return prompt_cache.markdown({**HEAD, "layout": "prefix", "workload": "L-Eval", "lengths": [1024], "results": rows})


def window_table() -> str:
    def config(name: str) -> dict:
        return {
            "name": name,
            "sequence": {"prompt_tokens": 8176, "new_tokens": 16, "decode_bytes": 1e7 + X,
                         "prefill_peak_bytes": 2e7 + X, "prefill_seconds": 30 + X, "decode_seconds_per_token": X},
            "concurrency": {"prompt_tokens": 4064, "max_tokens": 32, "num_requests": 64, "peak_running": 40,
                            "peak_kv_bytes": 1e9 + X, "kv_pool_bytes": 1.07e9, "output_tokens_per_s": 80 + X,
                            "decode_tokens_per_s": 90 + X, "seconds": 400 + X, "steps": 70, "preemptions": 0,
                            "max_load_average": 2 + X},
        }  # fmt: skip

    return window.markdown({
        **HEAD, "cpu": "Test CPU", "kv_cache_memory": "1GiB",
        "settings": {"prefill_chunk": 2048, "max_num_seqs": 256, "batch_tokens": 8192},
        "results": {"configurations": [config("window groups"), config("every layer full")],
                    "analytic_bytes": {"full": 3e7, "windows": 1e7}},
    })  # fmt: skip


def soak_table() -> str:
    results = {
        "requests": 120, "elapsed_s": 600 + X, "options": {"concurrency": 8, "prefill_parallel": 2, "chaos": True,
                                                       "faults": "swap=0.05"},
        "by_kind": {"stream": {"sent": 60, "as_expected": 60, "statuses": {"200": 60}, "fault_errors": 2,
                               "hung_up": 0}},
        "exactly_once": True, "engine_requests_accepted": 100, "engine_requests_ended": 100.0,
        "engine_requests_uncertain": 3, "fault_errors": 2, "preemptions": 4.0, "faults_injected": 9.0,
        "fault_log_lines": 9,
        "kv_audit": [{"request_sequences": 0.0, "leaked_blocks": 0.0, "kv_cache_usage": 0.01 + X / 100}],
        "lives": [{"start_s": 0.0, "schema_s": 1 + X, "first_pml_ttft_s": None, "warm_pml_ttft_s": 0.05 + X},
                  {"start_s": 300 + X, "schema_s": 0.1 + X, "first_pml_ttft_s": 0.06 + X, "warm_pml_ttft_s": None}],
        "ended_by_reason": {'kvserve:request_success_total{finished_reason="stop"}': 100.0},
        "left_running_or_waiting": 0.0, "prefill_metrics": {"kvserve:prefill_parallel_restarts_total": 1.0},
        "health": {"probes": 6000, "not_200": 0, "p50_ms": 2 + X, "p99_ms": 20 + X, "max_ms": 90 + X,
                   "during_restarts": 40},
        "server_rss_mib": {"second_quarter": 700 + X, "last_quarter": 710 + X, "max": 730 + X, "since_s": 305 + X},
        "events": [[300 + X, "SIGKILL prefill worker 4321"]], "processes_left_after_stop": [4321, 4322],
    }  # fmt: skip
    return soak.soak_table({**HEAD, "results": results})


def serve_table() -> str:
    stats = {"mean": 100 + X, "p50": 90 + X, "p99": 5 + X}
    summary = {"completed": 4, "failed": 0, "request_throughput": X, "output_token_throughput": 40 + X,
               "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats}  # fmt: skip
    return serve.table([{"request_rate": float("inf"), "concurrency": 16, "summary": summary}])


def eval_compare_table() -> str:
    return compare_table([_mc(0.6 + X, 0.01 + X), _mc(0.5 + X, 0.01 + X, kv_policy="h2o", kv_budget=0.5)], ["a", "b"])


WRITERS = {
    "latency": latency, "speed": speed, "prefill": prefill, "throughput": throughput, "prefix": prefix_table,
    "compression": compression_table, "offload": offload_table, "prompt-cache": prompt_cache_table,
    "window": window_table, "soak": soak_table, "serve": serve_table, "eval compare": eval_compare_table,
}  # fmt: skip


@pytest.mark.parametrize("name", WRITERS)
def test_markdown_has_no_python_repr(name):
    markdown = WRITERS[name]()
    assert "|" in markdown
    raw = [line for line in markdown.splitlines() if RAW_REPR.search(line)]
    assert raw == []


def test_the_fixed_writers_print_words_and_tables():
    assert "Machine: Test CPU, 2 vCPU, 15.6 GiB, torch 2.13.0+cpu." in offload_table()
    assert "| KVR-S | 384 + 616 | 1120 + 880 |" in prefill()
    assert "Processes left after stopping the server: 4321, 4322." in soak_table()
    assert "| 9 | 2 | 40.0 | 40.1 | 50.1 | 1.00x / 1.00x / 1.00x |" in compression_table()  # prompt steps: 60 - 20 s

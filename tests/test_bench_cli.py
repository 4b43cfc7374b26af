"""``kvserve bench throughput`` runs end to end and writes a report whose numbers add up (tiny model, no peer)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tiny_models import TinySpec, write_tiny_model


@pytest.mark.slow
def test_bench_throughput_writes_a_consistent_report(tmp_path):
    model = write_tiny_model(tmp_path / "model", TinySpec(num_heads=4, num_kv_heads=2))
    out = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable, "-m", "kvserve", "bench", "throughput", "--model", str(model), "--threads", "1",
            "--num-requests", "6", "--scale", "40", "--batch-sizes", "1,2", "--decode-tokens", "3",
            "--kv-cache-memory", "4MiB", "--no-peer", "--output", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    (kvserve,) = report["results"]
    assert kvserve["num_requests"] == 6
    assert kvserve["output_tokens"] == report["workload"]["output_tokens"]  # every request ran to its length
    assert kvserve["prompt_tokens"] == report["workload"]["prompt_tokens"]
    assert 0 <= kvserve["kv_waste_pct"] < 100
    assert set(report["decode_scaling_tokens_per_s"]["kvserve"]) == {"1", "2"}
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| kvserve |" in out.with_suffix(".md").read_text()

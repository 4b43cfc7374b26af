"""``kvserve bench tensor-parallel`` on a tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads) at sizes
1, 2 and 3: the report's structure, the all-reduce volumes the model implies, size 3 skipped with the reason,
and the CLI's refusal of a size the model cannot split. No timings are asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.entrypoints.cli import main
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=2, seed=3)
BATCH = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tp-bench") / "model", SPEC)


@pytest.fixture(scope="module")
def report(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "tp"
    args = ["bench", "tensor-parallel", "--models", str(folder), "--dtype", "float32", "--sizes", "1,2,3",
            "--prompt-tokens", "48", "--batch", str(BATCH), "--decode-steps", "3", "--repeats", "1",
            "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| 2 | decode b=4 |" in out.with_suffix(".md").read_text()
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.slow
def test_all_reduce_volumes_are_two_per_layer_of_the_step_rows(folder, report) -> None:
    result = report["models"][str(folder)]
    assert set(result["costs"]) == {"1", "2"}
    assert "num_heads (query heads)=4 must be divisible by 3" in result["skipped"]["3"]
    one, two = result["costs"]["1"], result["costs"]["2"]
    assert all(c["allreduce_calls"] == 0 and c["allreduce_bytes"] == 0 for c in one.values())
    rows = {"prefill": 48, "decode b=1": 1, f"decode b={BATCH}": BATCH}
    for phase, n in rows.items():
        assert two[phase]["allreduce_calls"] == 2 * SPEC.num_layers  # o_proj and down_proj of every layer
        assert two[phase]["allreduce_bytes"] == 2 * SPEC.num_layers * n * SPEC.hidden_size * 4  # float32
        assert 0 < two[phase]["allreduce_ms"] < two[phase]["step_ms"]
    links = {r["link"] for r in result["projection"]}
    assert len(links) == 3 and all(r["speedup"] > 0 for r in result["projection"])


@pytest.mark.slow
def test_the_cli_refuses_a_size_the_model_cannot_split(folder) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvserve", "generate", "--model", str(folder), "--dtype", "float32",
         "--tensor-parallel-size", "3", "--max-tokens", "2", "hello"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "tensor_parallel_size=3 does not divide the model: num_heads (query heads)=4" in done.stderr

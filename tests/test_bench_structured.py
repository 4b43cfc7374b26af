"""``kvserve bench structured`` runs end to end on a tiny model and writes a report whose numbers add up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.bench.structured import SCHEMAS, prompts
from tests.tiny_models import TinySpec, write_tiny_model


def test_the_prompts_cover_every_schema_early():
    assert {name for name, _ in prompts(len(SCHEMAS))} == set(SCHEMAS)
    assert len(prompts(50)) == 50 and len({text for _, text in prompts(50)}) == 50


@pytest.mark.slow
def test_bench_structured_writes_a_consistent_report(tmp_path):
    model = write_tiny_model(tmp_path / "model", TinySpec(num_heads=4, num_kv_heads=2, max_position_embeddings=2048))
    out = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable, "-m", "kvserve", "bench", "structured", "--model", str(model), "--threads", "1",
            "--num-prompts", "4", "--max-tokens", "24", "--kv-cache-memory", "8MiB", "--output", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    none, every, half = report["runs"]
    assert [r["constrained"] for r in report["runs"]] == [0, 4, 2]
    assert none["mask_steps"] == 0 and every["mask_steps"] > 0 and half["mask_steps"] > 0
    assert all(0 < r["output_tokens"] <= 4 * 24 and r["tokens_per_s"] > 0 for r in report["runs"])
    assert report["summary"]["valid_with"] == every["valid"] / 4
    assert report["summary"]["half_vs_none_tokens_per_s"] == half["tokens_per_s"] / none["tokens_per_s"]
    assert report["model"] == "model" and report["threads"] == 1 and report["machine"]["cpu"]
    assert "| all constrained | 4/4 |" in out.with_suffix(".md").read_text()

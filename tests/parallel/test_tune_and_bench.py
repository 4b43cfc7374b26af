"""``kvserve tune-runahead`` writes a table the engine's ``predicted`` partition reads; ``kvserve bench prefill``
and ``generate --prefill-parallel`` run end to end; engine options are validated. Tiny model, real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.prefill import bound
from kvserve.config import EngineConfig
from kvserve.models.loader import load_model
from kvserve.parallel.partition import PartitionTable
from kvserve.parallel.tune import default_lengths, tune_runahead
from tests.parallel.conftest import prompt


def test_default_lengths_are_powers_of_two_up_to_the_maximum() -> None:
    assert default_lengths(5000) == [512, 1024, 2048, 4096, 5000]
    assert default_lengths(2048) == [512, 1024, 2048]
    assert default_lengths(300) == [300]


def test_bound_is_the_papers_formula() -> None:
    assert bound(8.0, 1) == pytest.approx(8.0)
    assert bound(8.0, 2) == pytest.approx(8.0 / 2 * (1 / 2 + 1 / 4))  # 3 s: 2.67x
    assert bound(8.0, 4) == pytest.approx(8.0 / 2 * (1 / 4 + 1 / 16))


def test_engine_options_are_validated() -> None:
    with pytest.raises(ValueError, match="prefill_parallel must be a positive integer"):
        EngineConfig(prefill_parallel=0)
    with pytest.raises(ValueError, match="prefill_partition must be one of"):
        EngineConfig(prefill_partition="ring")
    with pytest.raises(ValueError, match="runs on CPU"):
        EngineConfig(prefill_parallel=2, device="cuda")


@pytest.mark.slow
def test_predicted_without_a_table_names_the_missing_file(tiny, tmp_path, monkeypatch) -> None:
    folder, _ = tiny
    missing = tmp_path / "none.json"
    monkeypatch.setenv("KVSERVE_RUNAHEAD_TABLE", str(missing))
    with pytest.raises(ValueError, match=f"needs a table at {missing}"):
        LLM(model=str(folder), dtype="float32", prefill_parallel=2, prefill_partition="predicted")


@pytest.mark.slow
def test_tuned_table_drives_the_predicted_partition(tiny, tmp_path, monkeypatch) -> None:
    folder, _ = tiny
    table_path = tmp_path / "table.json"
    loaded = load_model(folder)
    table = tune_runahead(loaded, "dequant", 2, [64, 128], table_path, step=16, log=lambda _: None)
    assert table.lengths(2) == [64, 128]
    saved = json.loads(table_path.read_text())
    assert saved["machine"]["model"] == folder.name and saved["machine"]["threads_per_process"] >= 1
    monkeypatch.setenv("KVSERVE_RUNAHEAD_TABLE", str(table_path))
    llm = LLM(model=str(folder), dtype="float32")  # no parallel prefill: the table is not needed
    assert llm.engine.parallel_prefill is None
    parallel = LLM(model=str(folder), dtype="float32", prefill_parallel=2)  # default: predicted, the table exists
    try:
        prefill = parallel.engine.parallel_prefill
        assert prefill.partition == "predicted"
        assert prefill.boundaries(96) == PartitionTable.load(table_path).predict(96, 2).boundaries
        ids = prompt(96)
        got = parallel.generate(ids, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
        want = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    finally:
        parallel.engine.close()


@pytest.mark.slow
def test_bench_prefill_reports_every_method(tiny, tmp_path) -> None:
    folder, _ = tiny
    out = tmp_path / "prefill"
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", "bench", "prefill", "--model", str(folder), "--dtype", "float32",
         "--lengths", "64,96", "--repeats", "1", "--table", str(tmp_path / "table.json"), "--output", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(report["ttft_s"]) == {"single", "KVR-E", "KVR-S", "KVR-P", "TSP"}
    assert all(set(by_length) == {"64", "96"} for by_length in report["ttft_s"].values())
    assert report["partitions"]["KVR-E"]["96"] == [48, 48] and sum(report["partitions"]["KVR-S"]["96"]) == 96
    assert report["bound_s"]["96"] == pytest.approx(bound(report["ttft_s"]["single"]["96"], 2))
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.slow
def test_generate_with_parallel_prefill_prints_the_same_text(tiny) -> None:
    folder, _ = tiny
    text = "hello world " * 30

    def generate(*extra: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "kvserve", "generate", "--model", str(folder), "--dtype", "float32",
             "--max-tokens", "8", *extra, text],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert generate("--prefill-parallel", "2", "--prefill-partition", "even") == generate()

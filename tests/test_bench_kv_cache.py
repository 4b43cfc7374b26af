"""``kvserve bench kv-cache`` on a tiny random float32 Llama (2 layers, 2 KV heads of 16): the report's sections
for every KV dtype, the plan's bytes per token (an int8 row is D + 2 bytes, a float32 one 4 D), more int4 sequences
than model-dtype ones running at once in one small KV memory, and greedy agreement. No timings are asserted."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from kvserve.bench import kv_cache_dtype as kvc
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.cli import main
from kvserve.models import load_model
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401

SPEC = TinySpec(num_kv_heads=2, head_dim=16, num_layers=2)
DTYPES = ("auto", "int8", "int4")
# 64-token sequences in blocks of 4: the capacity check's memory holds two of the float32 cache's.
TINY_ARGS = [
    "--dtype", "float32", "--threads", "1", "--block-size", "4", "--seq-len", "64", "--kv-cache-memory", "64KiB",
    "--check-sequences", "2", "--contexts", "24,48", "--batch-sizes", "1,2", "--decode-tokens", "3",
    "--prefill-chunk", "64", "--ppl-tokens", "200", "--ppl-context", "48", "--ppl-stride", "24", "--ppl-chunk", "16",
    "--agreement-prompts", "3", "--agreement-tokens", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), SPEC)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(tiny_model, dtype=torch.float32)


@pytest.fixture(scope="module")
def report(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "kv-cache"
    assert main(["bench", "kv-cache", "--model", str(tiny_model), *TINY_ARGS, "--output", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 1000
    text = out.with_suffix(".md").read_text()
    for heading in ("## Capacity", "## Decode speed by context", "## Accuracy"):
        assert heading in text
    return json.loads(out.with_suffix(".json").read_text())


def bench(**fields) -> kvc.KVCacheBench:
    options = dict(engine_options={"dtype": "float32"}, block_size=4, seq_len=64, kv_cache_memory="64KiB")
    return kvc.KVCacheBench(**{**options, **fields})


@pytest.mark.slow
def test_report_has_every_section_and_dtype(report):
    assert report["benchmark"] == "kv-cache" and report["dtype"] == "float32" and report["threads"] == 1
    assert report["kv_cache_dtypes"] == list(DTYPES) and report["machine"]["cpu"] in report["cpu"]
    assert report["peers"] == {} and report["settings"]["seq_len"] == 64
    results = report["results"]
    assert results["baseline"] == "auto"
    assert list(results["capacity"]["dtypes"]) == list(DTYPES)
    assert list(results["accuracy"]["dtypes"]) == list(DTYPES)
    cells = results["speed"]["cells"]
    assert {(c["kv_cache_dtype"], c["context"], c["batch"]) for c in cells} == {
        (d, c, b) for d in DTYPES for c in (24, 48) for b in (1, 2)
    }
    for c in cells:
        assert c["engine"] == "kvserve" and c["steps"] == 3 and c["tokens_per_s"] > 0 and c["ms_per_step"] > 0
        assert c["vs_baseline"] == pytest.approx(c["tokens_per_s"] / next(
            b["tokens_per_s"] for b in cells if (b["kv_cache_dtype"], b["context"], b["batch"]) ==
            ("auto", c["context"], c["batch"])))  # fmt: skip
    for d, row in results["accuracy"]["dtypes"].items():
        assert row["perplexity"]["scored_tokens"] == 199 and row["perplexity"]["perplexity"] > 1
        assert len(row["tokens"]) == 3 and all(len(t) == 8 for t in row["tokens"])
        assert 0 <= row["agreement"]["identical"] <= row["agreement"]["prefix_agreement"] <= 1, d
    assert results["accuracy"]["dtypes"]["auto"]["perplexity_change"] == 0


@pytest.mark.slow
def test_capacity_plan_and_run(report):
    """int8 rows take D + 2 bytes against float32's 4 D; the run fits more int4 sequences than auto ones."""
    rows = report["results"]["capacity"]["dtypes"]
    auto, int8, int4 = (rows[d] for d in DTYPES)
    assert auto["plan"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, K and V, KV heads, D, float32
    assert int8["plan"]["bytes_per_token"] == 2 * 2 * 2 * (16 + 2) < auto["plan"]["bytes_per_token"]
    assert int4["plan"]["bytes_per_token"] == 2 * 2 * 2 * (16 // 2 + 4)
    assert auto["measured"]["planned_sequences"] == 2 == auto["measured"]["peak_running"]
    assert int4["measured"]["peak_running"] > auto["measured"]["peak_running"]
    assert int8["vs_baseline"]["bytes_per_token"] == pytest.approx(64 / 18)
    for row in (auto, int8, int4):
        m = row["measured"]
        assert m["num_requests"] == m["planned_sequences"] + 2
        assert m["output_tokens"] == m["num_requests"] * kvc.CHECK_NEW_TOKENS
        assert m["peak_running"] >= m["planned_sequences"] - 1


@pytest.mark.slow
def test_auto_agrees_with_itself(report, loaded):
    """The report's auto row, and a second auto engine's greedy tokens against the first's."""
    rows = report["results"]["accuracy"]["dtypes"]
    auto = rows["auto"]["agreement"]
    assert auto["prefix_agreement"] == 1.0 and auto["identical"] == 1.0
    # Teacher-forced, the greedy engine's own tokens are its top tokens (float32 tiny model: no ties).
    assert rows["auto"]["same_top_token"] == 1.0
    assert all(0 < row["same_top_token"] <= 1 for row in rows.values())
    b = bench(agreement_prompts=3)
    prompts, _ = kvc.agreement_prompts(loaded, 3)
    memory = kvc.accuracy_memory(loaded, b, max(len(p) for p in prompts))
    outputs = []
    for _ in range(2):
        engine = LLMEngine(b.config("auto", memory, max_num_batched_tokens=16), loaded)
        outputs.append(kvc.generate_greedy(engine, prompts, 8))
        engine.close()
    assert kvc.agreement(outputs[0], outputs[1], 8)["prefix_agreement"] == 1.0


def test_plan_capacity_bytes_and_sequences(loaded):
    b = bench()
    auto, int8 = kvc.plan_capacity(loaded, b, "auto"), kvc.plan_capacity(loaded, b, "int8")
    assert (auto["bytes_per_token"], int8["bytes_per_token"]) == (512, 144)
    assert auto["seq_blocks"] == int8["seq_blocks"] == 16 and auto["seq_bytes"] == 64 * 512
    assert auto["sequences"] == 2 and auto["sequences_per_gib"] == 2**30 // (64 * 512)
    assert int8["sequences"] == (64 * 1024 // (4 * 144)) // 16
    assert kvc.check_memory(loaded, bench(check_sequences=3)) == 3 * 64 * 512


def test_agreement_arithmetic():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert kvc.agreement(ref, ref, 4) == {"prefix_agreement": 1.0, "identical": 1.0, "common_prefix_tokens": [4, 4]}
    got = kvc.agreement(ref, [[1, 2, 0, 4], [5, 6, 7, 8]], 4)
    assert got["prefix_agreement"] == pytest.approx((2 / 4 + 1) / 2) and got["identical"] == 0.5
    with pytest.raises(ValueError, match="as many outputs"):
        kvc.agreement(ref, ref[:1], 4)


def test_skip_flags_run_one_part(tiny_model, tmp_path):
    out = tmp_path / "capacity-only"
    args = [*TINY_ARGS, "--kv-cache-dtypes", "auto,int4", "--skip-speed", "--skip-accuracy", "--output", str(out)]
    assert main(["bench", "kv-cache", "--model", str(tiny_model), *args]) == 0
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(results) == {"baseline", "capacity"} and list(results["capacity"]["dtypes"]) == ["auto", "int4"]
    assert "Not run: speed, accuracy." in out.with_suffix(".md").read_text()


def test_bad_options_are_refused_before_loading(tiny_model, tmp_path, capsys):
    for options, message in (
        (["--kv-cache-dtypes", "auto,int3"], "kv_cache_dtype must be one of"),
        (["--kv-cache-dtypes", "auto,auto"], "names a dtype twice"),
        (["--peers", "vllm"], "unknown peer"),
    ):
        assert main(["bench", "kv-cache", "--model", str(tiny_model), *options]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp is installed here")
def test_llamacpp_peer_without_llama_cpp_names_the_fix(tmp_path, capsys):
    """Asked for explicitly, a missing llama_cpp is an error before anything loads (the default runs no peer)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    args = ["--peers", "llamacpp", "--llamacpp-python", sys.executable]
    assert main(["bench", "kv-cache", "--model", str(gguf), *args]) == 2
    assert "llama-cpp-python" in capsys.readouterr().err


FAKE_WORKER = """
import argparse, json, sys
parser = argparse.ArgumentParser()
parser.add_argument("model")
for flag in ("--threads", "--n-ctx", "--max-seqs", "--type-k", "--type-v", "--flash-attn"):
    parser.add_argument(flag)
args = parser.parse_args()
settings = {"n_ctx": int(args.n_ctx), "kv_unified": True, "type_k": args.type_k, "type_v": args.type_v,
            "flash_attn": args.flash_attn, "use_extra_bufts": False}
print(json.dumps({"ready": True, "load_s": 0.1, "llama_cpp": "0.0.test", "system_info": "CPU", **settings}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "quit":
        break
    n = command["new_tokens"]
    tokens = [[1] * n for _ in command["prompts"]]
    print(json.dumps({"seconds": 1.0 + 0.01 * n, "first_token_s": 1.0, "tokens": tokens}), flush=True)
"""


def test_llamacpp_cells_from_its_worker(loaded, tmp_path, monkeypatch):
    """The peer's decode cells from a stand-in speaking the worker's protocol: one worker per KV type with flash
    attention on, the decode time after the first tokens, ratios against its own f16 cache, and the report."""
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(kvc, "WORKER", worker)
    b = bench(contexts=(16,), batch_sizes=(1, 2), decode_tokens=3)
    speed = kvc.run_speed(loaded, b, lambda _: None, (sys.executable, tmp_path / "m.gguf"))
    peer = [c for c in speed["cells"] if c["engine"] == "llama.cpp"]
    assert [(c["kv_cache_dtype"], c["kv_type"], c["batch"]) for c in peer] == [
        (d, t, n) for d, t in (("auto", "f16"), ("int8", "q8_0"), ("int4", "q4_0")) for n in (1, 2)
    ]
    for c in peer:
        assert c["seconds"] == pytest.approx(0.04) and c["tokens_per_s"] == pytest.approx(c["batch"] * 3 / 0.04)
        assert c["vs_baseline"] == pytest.approx(1.0)  # against llama.cpp's own f16 cells
    runs = speed["llama.cpp"]["runs"]
    assert set(runs) == {"f16", "q8_0", "q4_0"} and speed["llama.cpp"]["version"] == "0.0.test"
    assert all(r["flash_attn"] == "on" and r["use_extra_bufts"] is False and r["type_k"] == r["type_v"]
               for r in runs.values())  # fmt: skip
    machine = {"cpu": "Test CPU", "nproc": 2, "memory_gib": 15.6, "torch": "2.13.0+cpu"}
    report = {"model": "m.gguf", "dtype": "float32", "weights": "native", "threads": 1, "date": "2026-12-03",
              "command": "kvserve bench kv-cache", "machine": machine, "cpu": "Test CPU",
              "results": {"baseline": "auto", "speed": speed}}  # fmt: skip
    text = kvc.markdown(report)
    assert "use_extra_bufts=False" in text and "| llama.cpp | q4_0 | 16 | 2 |" in text
    assert "Not run: capacity, accuracy." in text


def test_contexts_past_the_model_are_refused_before_anything_runs(loaded):
    b = bench(contexts=(loaded.config.max_position_embeddings,), decode_tokens=4)
    with pytest.raises(ValueError, match="past the model's context"):
        kvc.run(loaded, b, log=lambda line: None)

"""``kvserve bench soak --chaos`` on the default model, short: a real server on loopback with I/O faults injected
at the swap space and the Prompt Cache module directory, a KV memory small enough to preempt, a prefill worker
killed in each of its two lives and a restart over the persisted modules. Every kind of traffic is answered as
it must be (or with the injected fault's error), every accepted request ends exactly once, the KV pool is whole
once idle, and no process is left. Latency is reported by the benchmark, not asserted here."""

from __future__ import annotations

import pytest

from kvserve.bench.soak import KIND_WEIGHTS, SoakOptions, run_soak, soak_table

pytestmark = pytest.mark.real_model


def test_short_chaos_soak_ends_every_request_once_and_leaves_nothing(tmp_path):
    opts = SoakOptions(
        duration_s=50.0, concurrency=4, prefill_parallel=2, kill_worker_at=0.4, threads=1, seed=3, chaos=True,
        faults="swap=0.5,module-dir-write=0.5,module-dir-read=0.5",
    )  # fmt: skip
    results = run_soak(opts, print)

    assert results["num_unexpected"] == 0, results["unexpected"]
    assert results["exactly_once"], (results["engine_requests_accepted"], results["ended_by_reason"])
    assert results["left_running_or_waiting"] == 0
    assert results["processes_left_after_stop"] == []
    assert results["health"]["not_200"] == 0
    assert [a["request_sequences"] for a in results["kv_audit"]] == [0, 0]
    assert [a["leaked_blocks"] for a in results["kv_audit"]] == [0, 0]
    assert results["faults_injected"] > 0
    assert results["lives"][1]["first_pml_ttft_s"] is not None  # restarted, and served Prompt Cache again
    kills = [event for _, event in results["events"] if "killed prefill worker" in event]
    assert len(kills) == 2, results["events"]
    sent = {kind: k["sent"] for kind, k in results["by_kind"].items()}
    assert all(sent[kind] > 0 for kind in ("stream", "complete", "bad", "pml")), sent
    assert set(results["by_kind"]) == set(KIND_WEIGHTS) | {"hangup"}
    report = {"command": "kvserve bench soak", "date": "today", "machine": {"cpu": "cpu", "nproc": 2, "torch": "x"},
              "model": "m", "results": results}  # fmt: skip
    assert "exactly once: **True**" in soak_table(report)

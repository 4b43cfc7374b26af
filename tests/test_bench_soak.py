"""``kvserve bench soak`` on the default model, short: a real server on loopback with a prefill worker killed
mid-way, every kind of traffic answered as it must be, every accepted request ended exactly once, no
process left behind. Latency is reported by the benchmark, not asserted here."""

from __future__ import annotations

import pytest

from kvserve.bench.soak import KIND_WEIGHTS, SoakOptions, run_soak, soak_table

pytestmark = pytest.mark.real_model


def test_short_soak_ends_every_request_once_and_leaves_nothing(tmp_path):
    opts = SoakOptions(duration_s=40.0, concurrency=4, prefill_parallel=2, kill_worker_at=0.3, threads=1, seed=3)
    results = run_soak(opts, print)

    assert results["num_unexpected"] == 0, results["unexpected"]
    assert results["exactly_once"], (results["engine_requests_accepted"], results["ended_by_reason"])
    assert results["left_running_or_waiting"] == 0
    assert results["processes_left_after_stop"] == []
    assert results["health"]["not_200"] == 0
    assert any("killed prefill worker" in event for _, event in results["events"]), results["events"]
    sent = {kind: k["sent"] for kind, k in results["by_kind"].items()}
    assert all(sent[kind] > 0 for kind in ("stream", "complete", "bad")), sent
    assert set(results["by_kind"]) == set(KIND_WEIGHTS)
    report = {"command": "kvserve bench soak", "date": "today", "machine": {"cpu": "cpu", "nproc": 2, "torch": "x"},
              "model": "m", "results": results}  # fmt: skip
    assert "exactly once: **True**" in soak_table(report)

"""Prefill workers over an engine's life: a killed worker's group is restarted with backoff while prompts
prefill locally, and ``/metrics`` shows it; a script without the main guard fails within seconds saying
what to do; ``close()`` / ``with`` leave no process, and engines may follow one another in a process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import kvserve
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import ParallelPrefillError
from kvserve.parallel import supervisor as supervisor_module
from kvserve.parallel.supervisor import GroupSupervisor
from tests.parallel.conftest import prompt
from tests.server.conftest import start_server, wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
REPO = Path(kvserve.__file__).resolve().parents[1]
MAIN_GUARD = 'if __name__ == "__main__":'


def continuation(llm: LLM, ids: list[int]) -> list[int]:
    return llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


# ----- restart with backoff (the supervisor alone, on a fake clock) -----


class FakeWorker:
    def __init__(self) -> None:
        self.alive, self.name, self.exitcode = True, "kvserve-prefill-0", None

    def is_alive(self) -> bool:
        return self.alive


class FakeGroup:
    def __init__(self) -> None:
        self.workers, self.closed = [FakeWorker()], False

    def close(self) -> None:
        self.closed = True


def test_backoff_doubles_to_the_cap_and_resets_after_a_good_prefill(monkeypatch) -> None:
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(supervisor_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    starts = []

    def start(cancel) -> FakeGroup:
        starts.append(clock.now)
        if len(starts) <= 3:
            raise ParallelPrefillError("the prefill group did not start: worker exited")
        return FakeGroup()

    first = FakeGroup()
    sup = GroupSupervisor(first, 1, start, first_delay_s=1.0, max_delay_s=4.0, poll_s=3600)  # ticks by hand
    try:
        first.workers[0].alive = False
        sup.tick()  # noticed while idle: closed, next start in 1 s
        assert first.closed and sup.state().state == "restarting" and sup.state().workers_alive == 0
        for step in (0.5, 0.5, 2.0, 4.0, 4.0):
            clock.now += step
            sup.tick()
        assert [t - 100.0 for t in starts] == [1.0, 3.0, 7.0, 11.0]  # delays 1, 2, 4, then the cap 4
        state = sup.state()
        assert (state.state, state.restarts, state.failures, state.workers_alive) == ("up", 1, 4, 1)
        with sup.held():
            pass  # a successful prefill ends the streak
        sup.group.workers[0].alive = False
        sup.tick()
        assert sup.restart_at == clock.now + 1.0  # back to the first delay
    finally:
        sup.close()
    sup.close()  # idempotent
    with pytest.raises(ParallelPrefillError, match="not running"):
        with sup.held():
            pass


def test_a_joined_group_that_is_lost_stays_off() -> None:
    group = FakeGroup()
    sup = GroupSupervisor(group, 1, start=None, poll_s=3600)
    try:
        with pytest.raises(ParallelPrefillError), sup.held():
            raise ParallelPrefillError("rank 1: receiving layer 0's KV failed")
        assert group.closed and sup.state().state == "off" and sup.restart_at is None
    finally:
        sup.close()


# ----- restart of real worker processes -----


@pytest.mark.slow
def test_killed_worker_is_restarted_while_prompts_prefill_locally(tiny) -> None:
    folder, _ = tiny
    ids = prompt(80)
    expected = continuation(LLM(model=str(folder), dtype="float32"), ids)
    options = dict(prefill_parallel=2, prefill_partition="even", enable_prefix_caching=False)  # every prompt qualifies
    llm = LLM(model=str(folder), dtype="float32", **options)
    parallel = llm.engine.parallel_prefill
    try:
        runs = []
        run = parallel.run
        parallel.run = lambda *args: runs.append(run(*args)) or runs[-1]  # records each parallel prefill's result
        old = parallel.group.workers[0]
        os.kill(old.pid, signal.SIGKILL)
        wait_until(lambda: parallel.group is None, timeout=10)  # noticed and closed with no prefill running
        assert continuation(llm, ids) == expected  # served meanwhile
        start = time.monotonic()
        wait_until(lambda: parallel.available, timeout=120)
        restart_s = time.monotonic() - start
        state = parallel.state()
        assert (state.state, state.restarts, state.failures, state.workers_alive) == ("up", 1, 1, 1)
        new = parallel.group.workers[0]
        assert new.pid != old.pid
        assert continuation(llm, ids) == expected
        assert runs and runs[-1] is not None  # the last prompt prefilled over the new group
    finally:
        llm.engine.close()
    assert not new.is_alive() and not parallel.available
    print(f"group restarted {restart_s:.1f} s after the loss was noticed")


@pytest.mark.slow
def test_metrics_show_a_killed_worker_and_the_restart_while_health_stays_200(tiny) -> None:
    folder, loaded = tiny
    config = EngineConfig(model=str(folder), dtype="float32", prefill_parallel=2, prefill_partition="even")
    engine = LLMEngine(config, loaded)
    server = start_server(engine)
    workers = list(engine.parallel_prefill.group.workers)
    try:
        before = server.metrics()
        assert before["kvserve:prefill_parallel_up"] == 1 and before["kvserve:prefill_parallel_workers"] == 1
        assert before["kvserve:prefill_parallel_workers_alive"] == 1
        assert before["kvserve:prefill_parallel_restarts_total"] == 0
        os.kill(workers[0].pid, signal.SIGKILL)
        wait_until(lambda: server.metrics()["kvserve:prefill_parallel_workers_alive"] == 0, timeout=10)
        assert server.metrics()["kvserve:prefill_parallel_up"] == 0
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # degraded, still serving
        reply = server.client().completions.create(model="tiny", prompt=prompt(80), max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        wait_until(lambda: server.metrics()["kvserve:prefill_parallel_up"] == 1, timeout=120)
        after = server.metrics()
        assert after["kvserve:prefill_parallel_workers_alive"] == 1
        assert after["kvserve:prefill_parallel_restarts_total"] == 1
        assert after["kvserve:prefill_parallel_failures_total"] == 1
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        workers += engine.parallel_prefill.group.workers
    finally:
        server.stop()
        engine.close()
    assert not any(w.is_alive() for w in workers)


# ----- close() -----


def test_close_stops_the_offload_thread_leaves_no_file_and_refuses_new_requests(tiny, tmp_path, monkeypatch) -> None:
    # A core free for the transfer worker, however many threads torch runs here (else copies run inline).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    folder, loaded = tiny
    config = EngineConfig(model=str(folder), dtype="float32", kv_cache_memory="4MiB", kv_offload="disk",
                          kv_offload_path=str(tmp_path))  # fmt: skip
    with LLM.from_engine(LLMEngine(config, loaded)) as llm:
        cache = llm.engine.runner.cache
        assert len(continuation(llm, prompt(40))) == GREEDY.max_tokens
        assert cache.queue._worker.is_alive()
    assert not cache.queue._worker.is_alive()
    assert list(tmp_path.iterdir()) == []  # the disk tier's file was unlinked when mapped
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompt(40), GREEDY, use_tqdm=False)


# ----- scripts: the main guard, engines one after another, close / with -----


def run_script(path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the kvserve under test, whatever is installed
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout, cwd=path.parent, env=env
    )
    return result, time.monotonic() - start


UNGUARDED = """from kvserve import LLM

llm = LLM(model={model}, dtype="float32", prefill_parallel=2)
print("built")
"""


def check_unguarded_script_fails_fast(tmp_path: Path, model: str | None) -> float:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(model=repr(model)))
    result, seconds = run_script(script, timeout=120)
    assert result.returncode != 0 and "built" not in result.stdout
    assert "ParallelPrefillError" in result.stderr and MAIN_GUARD in result.stderr, result.stderr[-3000:]
    assert seconds < 60
    return seconds


@pytest.mark.slow
def test_script_without_main_guard_fails_within_seconds_saying_what_to_do(tiny, tmp_path) -> None:
    seconds = check_unguarded_script_fails_fast(tmp_path, str(tiny[0]))
    print(f"unguarded script failed after {seconds:.1f} s")


ONE_AFTER_ANOTHER = """import json
import multiprocessing
import sys
import threading

import psutil
import torch.distributed as dist

from kvserve import LLM, SamplingParams


def worker_processes():
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and any("spawn_main" in part for part in child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            pass
    return found


def main(model):
    ids = [3 + (7 * i) % 240 for i in range(80)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    options = dict(model=model, dtype="float32", prefill_parallel=2, prefill_partition="even")
    first = LLM(**options)
    a = first.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
    ran = [first.engine.parallel_prefill.available]
    del first  # dropped without close(): the next engine still gets a group
    with LLM(**options) as llm:
        b = llm.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
        ran.append(llm.engine.parallel_prefill.available)
    llm.close()  # again: nothing to do
    threads = [t.name for t in threading.enumerate() if t.name.startswith("kvserve")]
    print(json.dumps({
        "same": a == b, "ran": ran, "workers": worker_processes(), "threads": threads,
        "active_children": len(multiprocessing.active_children()), "initialized": dist.is_initialized(),
    }))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
"""


def check_engines_one_after_another(tmp_path: Path, model: str | None) -> None:
    script = tmp_path / "one_after_another.py"
    script.write_text(ONE_AFTER_ANOTHER)
    result, _ = run_script(script, *([model] if model else []), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "same": True, "ran": [True, True], "workers": [], "threads": [], "active_children": 0, "initialized": False,
    }  # fmt: skip


@pytest.mark.slow
def test_engines_one_after_another_and_with_leaves_no_process(tiny, tmp_path) -> None:
    check_engines_one_after_another(tmp_path, str(tiny[0]))


@pytest.mark.real_model
def test_real_model_unguarded_script_fails_fast_and_engines_follow_one_another(tmp_path) -> None:
    seconds = check_unguarded_script_fails_fast(tmp_path, None)
    print(f"unguarded script (default model) failed after {seconds:.1f} s")
    check_engines_one_after_another(tmp_path, None)

"""Many clients at once: 64 simultaneous streams against a fresh server, its /metrics, and cancelled streams.

The server in this module is its own (module-scoped), so its counters count only what these tests send.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve import LLM, SamplingParams
from tests.server.conftest import TINY_NAME, TINY_OPTIONS, RunningServer, start_server, tiny_engine, wait_until

NUM_STREAMS = 64


@pytest.fixture(scope="module")
def server(tiny_folder, tiny_loaded):
    running = start_server(tiny_engine(tiny_folder, tiny_loaded))
    yield running
    running.stop()


def prompt(i: int) -> str:
    return f"request {i}: the cat sat on the mat" + " and then the cat ran" * (i % 4)


def max_tokens(i: int) -> int:
    return 8 + (i * 7) % 25  # 8..32: the streams finish at different steps


@pytest.mark.slow
def test_64_simultaneous_streams_equal_their_greedy_results_and_metrics_count_them(server: RunningServer, tiny_folder):
    llm = LLM(str(tiny_folder), **TINY_OPTIONS)
    params = [SamplingParams(max_tokens=max_tokens(i), temperature=0, ignore_eos=True) for i in range(NUM_STREAMS)]
    expected = llm.generate([prompt(i) for i in range(NUM_STREAMS)], params, use_tqdm=False)

    async def one(client, i: int) -> tuple[str, list]:
        stream = await client.completions.create(
            model=TINY_NAME, prompt=prompt(i), max_tokens=max_tokens(i), temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks

    async def run_all() -> list[tuple[str, list]]:
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(run_all())
    for i, ((text, chunks), want) in enumerate(zip(results, expected, strict=True)):
        assert text == want.outputs[0].text, f"stream {i}"
        assert chunks[-1].usage.completion_tokens == max_tokens(i)
        assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    wait_until(lambda: server.metrics()["kvserve:num_requests_running"] == 0)
    metrics = server.metrics()
    prompt_tokens = sum(len(out.prompt_token_ids) for out in expected)
    generated = sum(max_tokens(i) for i in range(NUM_STREAMS))
    assert metrics["kvserve:prompt_tokens_total"] == prompt_tokens
    assert metrics["kvserve:generation_tokens_total"] == generated
    assert metrics["kvserve:prefix_cache_queries_total"] == prompt_tokens  # each prompt looked up once
    assert 0 <= metrics["kvserve:prefix_cache_hits_total"] < prompt_tokens
    assert metrics["kvserve:e2e_request_latency_seconds_count"] == NUM_STREAMS
    assert metrics["kvserve:time_to_first_token_seconds_count"] == NUM_STREAMS
    assert metrics["kvserve:inter_token_latency_seconds_count"] == generated - NUM_STREAMS  # one per later token
    assert metrics["kvserve:request_success_total{finished_reason=length}"] == NUM_STREAMS
    assert metrics["kvserve:num_requests_waiting"] == 0
    assert metrics["kvserve:kv_cache_usage_perc"] == 0
    assert metrics["kvserve:num_preemptions_total"] == 0


def test_cancelled_streams_are_aborted_and_free_their_blocks(server: RunningServer):
    engine = server.engine.engine
    before = server.metrics()
    num_cancelled = 8

    async def cancel_after_a_few_chunks(client, i: int) -> int:
        stream = await client.completions.create(
            model=TINY_NAME, prompt=prompt(i) * 3, max_tokens=900, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        return seen

    async def run_all() -> None:
        async with server.async_client(timeout=60) as client:
            await asyncio.gather(*(cancel_after_a_few_chunks(client, i) for i in range(num_cancelled)))

    asyncio.run(run_all())
    # The requests stop long before their 900 tokens, and every block comes back.
    wait_until(lambda: server.metrics()["kvserve:kv_cache_usage_perc"] == 0)
    after = server.metrics()
    assert after["kvserve:request_success_total{finished_reason=abort}"] == num_cancelled
    assert after["kvserve:num_requests_running"] == 0
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < num_cancelled * 900
    assert after["kvserve:e2e_request_latency_seconds_count"] == before["kvserve:e2e_request_latency_seconds_count"]
    assert server.engine.num_active == 0
    assert engine.kv_usage().used_blocks == 0
    # and the server goes on serving
    response = server.client().completions.create(model=TINY_NAME, prompt="hello", max_tokens=3)
    assert response.usage.completion_tokens == 3


def test_a_disconnected_non_streaming_request_is_aborted(server: RunningServer):
    before = server.metrics()["kvserve:request_success_total{finished_reason=abort}"]
    body = {"model": TINY_NAME, "prompt": "the cat", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=0.3)
    wait_until(lambda: server.metrics()["kvserve:request_success_total{finished_reason=abort}"] == before + 1)
    wait_until(lambda: server.metrics()["kvserve:kv_cache_usage_perc"] == 0)

"""``AsyncEngine`` on its own: the engine thread, the asyncio hand-off, errors through the queue, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from kvserve import SamplingParams
from kvserve.server.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from kvserve.server.metrics import ServerMetrics
from tests.server.conftest import tiny_engine


@pytest.fixture
def async_engine(tiny_folder, tiny_loaded):
    engine = AsyncEngine(tiny_engine(tiny_folder, tiny_loaded, max_num_seqs=4), ServerMetrics("tiny"), max_queue=3)
    engine.start()
    yield engine
    engine.shutdown()


def ids(engine: AsyncEngine, text: str) -> list[int]:
    return engine.engine.tokenizer.encode(text)


@pytest.mark.slow
def test_outputs_reach_asyncio_and_match_a_direct_engine_run(async_engine, tiny_folder, tiny_loaded):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = tiny_engine(tiny_folder, tiny_loaded)
    reference.add_request(ids(async_engine, "the cat"), params, request_id="r")
    while reference.has_unfinished_requests():
        (expected,) = reference.step()

    async def run():
        stream = async_engine.add_request("a", ids(async_engine, "the cat"), params)
        await stream.wait_accepted()
        return [out async for out in stream]

    outputs = asyncio.run(run())
    assert outputs[-1].finished and all(not out.finished for out in outputs[:-1])
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert outputs[-1].outputs[0].text == expected.outputs[0].text
    assert async_engine.num_active == 0


def test_an_engine_side_value_error_reaches_the_caller(async_engine):
    async def run():
        # best_of=5 > max_num_seqs=4: only LLMEngine.add_request (in the engine thread) knows
        stream = async_engine.add_request("bad", ids(async_engine, "hi"), SamplingParams(n=5, max_tokens=2))
        await stream.wait_accepted()

    with pytest.raises(ValueError, match="max_num_seqs"):
        asyncio.run(run())
    assert async_engine.num_active == 0 and async_engine.is_running


def test_the_queue_bound_counts_requests_until_they_finish(async_engine):
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)

    async def run():
        streams = await async_engine.add_requests([(f"r{i}", ids(async_engine, "hi"), long) for i in range(3)])
        with pytest.raises(QueueFullError):
            async_engine.add_request("one-too-many", ids(async_engine, "hi"), long)
        with pytest.raises(QueueFullError):  # all or none
            await async_engine.add_requests([("x", [5], long)])
        streams[0].abort()
        extra = async_engine.add_request("fits-now", ids(async_engine, "hi"), SamplingParams(max_tokens=2))
        await extra.wait_accepted()
        await extra.result()
        for stream in streams[1:]:
            stream.abort()

    asyncio.run(run())
    assert async_engine.num_active == 0


def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(async_engine):
    async def run():
        stream = async_engine.add_request(
            "long", ids(async_engine, "hi"), SamplingParams(max_tokens=900, ignore_eos=True)
        )
        await stream.wait_accepted()
        await stream.__anext__()
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            async_engine.add_request("late", ids(async_engine, "hi"), SamplingParams(max_tokens=2))

    asyncio.run(run())
    assert not async_engine.is_running
    assert not async_engine.engine.has_unfinished_requests()
    assert async_engine.engine.kv_usage().used_blocks == 0

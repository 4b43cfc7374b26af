"""A request's ``kv_policy`` the engine cannot run is a 400 naming the field and the reason, the same reason
``EngineConfig`` gives when the command line asks for that combination at start-up.

Real uvicorn servers on loopback (tiny random model), driven by the official ``openai`` client.
"""

from __future__ import annotations

import openai
import pytest

from kvserve.config import EngineConfig
from tests.server.conftest import TINY_NAME, start_server, tiny_engine

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def pyramid_server(tiny_folder, tiny_loaded):
    running = start_server(tiny_engine(tiny_folder, tiny_loaded, kv_policy="pyramid", kv_budget=0.5))
    yield running
    running.stop()


def refusal(client: openai.OpenAI, **extra) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2, extra_body=extra)
    return caught.value.body


def test_a_policy_that_needs_an_offloaded_cache_is_refused_as_at_start_up(pyramid_server):
    policy = "int4"
    error = refusal(pyramid_server.client(), kv_policy=policy)
    with pytest.raises(ValueError) as at_start:
        EngineConfig(kv_policy=policy)
    assert error["param"] == "kv_policy"
    assert error["message"] == f"this engine cannot run kv_policy={policy!r} for a request: {at_start.value}"
    assert "kv_offload" in error["message"]
    assert not pyramid_server.engine.engine.requests  # nothing was queued


def test_infinigen_is_refused_on_an_engine_started_without_it(pyramid_server):
    """InfiniGen runs without offload too (sparse decode), but only as the engine's own policy: its partial keys
    are kept beside the cache from the start."""
    error = refusal(pyramid_server.client(), kv_policy="infinigen")
    assert error["param"] == "kv_policy"
    assert "started with kv_policy='pyramid'" in error["message"]
    assert "cannot pick kv_policy='infinigen'" in error["message"]
    assert not pyramid_server.engine.engine.requests  # nothing was queued


def test_the_pyramid_server_runs_the_policies_it_can(pyramid_server):
    client = pyramid_server.client()
    for extra in ({"kv_policy": "h2o", "kv_budget": 0.3}, {"kv_policy": "full"}, {"kv_budget": 0.25}, {}):
        reply = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=3, extra_body=extra)
        assert reply.usage.completion_tokens == 3, extra


@pytest.mark.slow
def test_other_refusals_name_the_field_that_asked(pyramid_server, tiny_server):
    assert refusal(pyramid_server.client(), kv_budget=1.5)["param"] == "kv_budget"
    with pytest.raises(openai.BadRequestError) as caught:
        pyramid_server.client().completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2, n=2)
    assert caught.value.body["param"] == "n" and "n and best_of must be 1" in caught.value.body["message"]
    error = refusal(tiny_server.client(), kv_policy="pyramid")  # a full-cache engine has one KV group
    assert error["param"] == "kv_policy" and "per-layer KV groups" in error["message"]
    reply = tiny_server.client().completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2)
    assert reply.usage.completion_tokens == 2

"""The OpenAI server over an offloading engine (KV in the host tier, InfiniGen selecting every row).

With ``infinigen_alpha`` huge and ``infinigen_partial_ratio`` 1 InfiniGen fetches every cached row, so
greedy completions and chat through the official ``openai`` client equal the paged (not offloaded)
engine token for token. ``/metrics`` counts the bytes the request moved between the tiers: parsed
values equal the engine's own counters, stores are exactly the request's KV rows and fetches at least
every cached row once per decode step. A request naming another ``kv_policy`` is a 400 that names
both policies, and the server goes on serving.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.policies.skewing import SKEWING_DIR_ENV
from tests.server.conftest import TINY_NAME, RunningServer, start_server, tiny_engine, wait_until

PROMPTS = ["the cat sat on the mat", "hello world", "one two three four five six seven eight nine ten"]
MESSAGES = [{"role": "user", "content": "hello there, how are you?"}]
EVERYTHING = {"infinigen_alpha": 1e9, "infinigen_partial_ratio": 1.0}  # InfiniGen that selects every row
FETCHED = "kvserve:kv_offload_fetched_bytes_total"
STORED = "kvserve:kv_offload_stored_bytes_total"


@pytest.fixture(scope="module")
def skewing_dir(tmp_path_factory) -> Iterator:
    """InfiniGen's skewing file goes to a temporary folder, never ~/.cache."""
    folder = tmp_path_factory.mktemp("skewing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SKEWING_DIR_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def server(tiny_folder, tiny_loaded, skewing_dir) -> Iterator[RunningServer]:
    engine = tiny_engine(tiny_folder, tiny_loaded, kv_offload="host", kv_policy="infinigen", **EVERYTHING)
    assert isinstance(engine.runner.cache, OffloadedKVCache) and engine.runner.cache.tier.kind == "host"
    assert [p.suffix for p in skewing_dir.iterdir()] == [".pt"]  # computed into the temporary folder
    running = start_server(engine)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def paged(tiny_folder, tiny_loaded) -> Iterator[LLM]:
    """The offline API over the paged engine (no offloading) on the same weights."""
    engine = tiny_engine(tiny_folder, tiny_loaded)
    assert not isinstance(engine.runner.cache, OffloadedKVCache)
    yield LLM.from_engine(engine)
    engine.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def cache_of(server: RunningServer) -> OffloadedKVCache:
    return server.engine.engine.runner.cache


def row_bytes(loaded) -> int:  # noqa: ANN001 - LoadedModel
    """One token's K and V in one layer, every KV head, as the host tier stores them (float32)."""
    cfg = loaded.config
    assert loaded.dtype == torch.float32
    return 2 * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.slow
def test_greedy_completions_equal_the_paged_engine(client, paged):
    expected = paged.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, logprobs=0), use_tqdm=False)
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS, max_tokens=16, temperature=0, logprobs=0)
    assert len(response.choices) == len(PROMPTS)
    for choice, out in zip(response.choices, expected, strict=True):
        want = out.outputs[0]
        assert choice.text == want.text and len(want.token_ids) == 16
        assert choice.finish_reason == want.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids, strict=True)], abs=1e-4
        )
    assert response.usage.completion_tokens == 16 * len(PROMPTS)


def test_greedy_chat_equals_the_paged_engine(client, paged):
    (expected,) = paged.chat(MESSAGES, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    response = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    (choice,) = response.choices
    assert choice.message.content == expected.outputs[0].text and expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_chat_through_the_offloaded_cache_equals_the_whole(client):
    kwargs = dict(model=TINY_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_metrics_count_the_bytes_moved_between_the_tiers(server, client, tiny_loaded):
    cache = cache_of(server)

    def settled() -> bool:  # the engine thread publishes its counters after each step
        now = server.metrics()
        return now[FETCHED] == cache.queue.stats.bytes_fetched and now[STORED] == cache.queue.stats.bytes_stored

    wait_until(settled)
    before = server.metrics()
    prompt = [298, *range(100, 137)]  # BOS + 37 ids no other test sends: no prefix hit
    response = client.completions.create(
        model=TINY_NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == 5
    wait_until(settled)
    after = server.metrics()
    assert after[FETCHED] > 0 and after[STORED] > 0
    layers, row = tiny_loaded.config.num_layers, row_bytes(tiny_loaded)
    # Every token that ran through the model went down once per layer (the last sampled one never runs) ...
    assert after[STORED] - before[STORED] == (len(prompt) + 5 - 1) * layers * row
    # ... and each of the 4 decode steps fetched every cached row of every layer (whole blocks at least).
    cached_rows = sum(len(prompt) + i for i in range(4))
    assert after[FETCHED] - before[FETCHED] >= cached_rows * layers * row


def test_a_request_for_another_kv_policy_is_a_400_naming_both(server, client, paged):
    for create, body in (
        (client.completions.create, {"prompt": PROMPTS[0]}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            create(model=TINY_NAME, max_tokens=4, temperature=0, extra_body={"kv_policy": "h2o"}, **body)
        assert error.value.status_code == 400
        message = error.value.body["message"]
        assert "kv_policy='infinigen'" in message and "kv_policy='h2o'" in message, message
    wait_until(lambda: not server.engine.engine.requests)  # nothing was left queued
    # The engine's own policy may be named; and the server goes on serving.
    named = client.completions.create(
        model=TINY_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, extra_body={"kv_policy": "infinigen"}
    )
    plain = client.completions.create(model=TINY_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    (expected,) = paged.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert named.choices[0].text == plain.choices[0].text == expected.outputs[0].text

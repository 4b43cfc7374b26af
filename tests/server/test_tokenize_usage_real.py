"""On the real default model (SmolLM2-135M-Instruct): ``/tokenize`` and ``/detokenize`` agree with the
Hugging Face tokenizer and with what the chat endpoint counts, a repeated prompt reports the tokens the
prefix cache served in ``usage.prompt_tokens_details.cached_tokens``, ``include_stop_str_in_output``
keeps the stop string, ``truncate_prompt_tokens`` keeps a prompt's last tokens, ``min_tokens`` holds back
the end of a reply and ``logit_bias`` bans a token."""

from __future__ import annotations

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

NAME = "SmolLM2-135M-Instruct"
BLOCK = 16
TEXT = "The capital of France is Paris; Tokyo's tower is 東京タワー 🗼, and 3.14 ≈ π."
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never invent facts you do not know. " * 3


@pytest.fixture(scope="module")
def server(default_model):
    engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", swap_space=0, block_size=BLOCK), default_model)
    running = start_server(engine, name=NAME)
    yield running
    running.stop()


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json={"model": NAME, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_and_detokenize_agree_with_transformers(server, hf_default_tokenizer):
    answer = post(server, "/tokenize", {"prompt": TEXT})
    assert answer["tokens"] == hf_default_tokenizer(TEXT)["input_ids"]
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 8192
    assert post(server, "/detokenize", {"tokens": answer["tokens"]}) == {"prompt": TEXT}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    chat = post(server, "/tokenize", {"messages": messages})
    rendered = hf_default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == hf_default_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    reply = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]


def test_a_repeated_prompt_reports_the_tokens_the_prefix_cache_served(server):
    client = server.client()
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of Italy?"}]
    first = client.chat.completions.create(model=NAME, messages=question, max_tokens=4, temperature=0)
    stream = client.chat.completions.create(
        model=NAME, messages=question, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = list(stream)[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached % BLOCK == 0 and usage.prompt_tokens - BLOCK <= cached < usage.prompt_tokens
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And of Spain?"}]
    shared = client.chat.completions.create(model=NAME, messages=other, max_tokens=4, temperature=0)
    assert 0 < shared.usage.prompt_tokens_details.cached_tokens < cached  # the system prompt's blocks only


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    client = server.client()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model=NAME, messages=question, max_tokens=24, temperature=0, stop=["Paris"])
    cut = client.chat.completions.create(**kwargs).choices[0]
    kept = client.chat.completions.create(**kwargs, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop" and "Paris" not in cut.message.content
    assert kept.message.content == cut.message.content + "Paris"


def test_truncate_prompt_tokens_answers_as_the_prompt_s_last_tokens(server):
    messages = [{"role": "user", "content": SYSTEM + "What is the capital of France?"}]
    ids = post(server, "/tokenize", {"messages": messages})["tokens"]
    client, kwargs = server.client(), dict(model=NAME, max_tokens=12, temperature=0)
    chat = client.chat.completions.create(messages=messages, extra_body={"truncate_prompt_tokens": 40}, **kwargs)
    plain = client.completions.create(prompt=ids[-40:], **kwargs)
    assert len(ids) > 40 and chat.usage.prompt_tokens == 40
    assert chat.choices[0].message.content == plain.choices[0].text


def test_min_tokens_holds_back_the_end_of_the_reply(server):
    client, question = server.client(), [{"role": "user", "content": "Say hello."}]
    free = client.chat.completions.create(model=NAME, messages=question, max_tokens=64, temperature=0)
    ended = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and ended < 40  # the model ends its reply by itself
    longer = client.chat.completions.create(
        model=NAME, messages=question, max_tokens=64, temperature=0, extra_body={"min_tokens": ended + 8}
    )
    assert longer.usage.completion_tokens >= ended + 8
    assert longer.choices[0].message.content.startswith(free.choices[0].message.content)


def test_logit_bias_bans_the_likeliest_answer(server):
    (paris,) = post(server, "/tokenize", {"prompt": " Paris", "add_special_tokens": False})["tokens"]
    kwargs = dict(model=NAME, prompt="The capital of France is", max_tokens=4, temperature=0)
    free = server.client().completions.create(**kwargs).choices[0].text
    banned = server.client().completions.create(**kwargs, logit_bias={str(paris): -100}).choices[0].text
    assert free.startswith(" Paris") and "Paris" not in banned

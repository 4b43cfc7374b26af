"""Request fields kvserve does not implement are a 400 naming them, never silently ignored; metadata and
fields sent switched off pass; ``usage.prompt_tokens_details.cached_tokens`` counts prefix-cache hits.

Real uvicorn server on loopback (tiny random model), driven by the official ``openai`` client.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.server.fields import UNSUPPORTED_FIELDS
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import TINY_NAME, TINY_OPTIONS

MESSAGES = [{"role": "user", "content": "hi"}]
BLOCK = TINY_OPTIONS["block_size"]

# A value that asks for something kvserve does not do, per field.
ASKING = {
    "suffix": " the end", "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "service_tier": "flex",
    "store": True, "web_search_options": {}, "reasoning_effort": "high", "verbosity": "low",
    "spaces_between_special_tokens": False, "bad_words": ["the"],
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "add_special_tokens": True, "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True}, "documents": [{"text": "x"}], "mm_processor_kwargs": {},
    "priority": 1, "request_id": "mine", "kv_transfer_params": {}, "vllm_xargs": {},
    "cache_prompt": False,
}  # fmt: skip
REQUESTS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def unsupported(endpoint: str, values: dict) -> dict:
    """``values`` of the fields the endpoint does not declare (completions implement echo, for one)."""
    out = {field: value for field, value in values.items() if field not in REQUESTS[endpoint].model_fields}
    assert len(out) > 25
    return out


def test_every_unsupported_field_has_an_asking_value_here():
    assert set(ASKING) == set(UNSUPPORTED_FIELDS)


def create(client: openai.OpenAI, endpoint: str, **kwargs):
    if endpoint == "chat":
        return client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=2, **kwargs)
    return client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_unsupported_field_is_a_400_naming_it(tiny_server, endpoint):
    client = tiny_server.client()
    for field, value in unsupported(endpoint, ASKING).items():
        with pytest.raises(openai.BadRequestError) as caught:
            create(client, endpoint, extra_body={field: value})
        assert caught.value.body["param"] == field
        assert caught.value.body["message"].startswith(f"'{field}' is not supported by kvserve"), field
    assert create(client, endpoint).usage.completion_tokens == 2  # the server goes on serving


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fields_that_ask_for_nothing_and_metadata_pass(tiny_server, endpoint):
    """Clients that send every default (null, or the value that switches a field off) keep working."""
    off = unsupported(endpoint, {field: offs[-1] for field, offs in UNSUPPORTED_FIELDS.items()})
    metadata = {"metadata": {"team": "a"}, "safety_identifier": "u-1", "prompt_cache_key": "k"}
    reply = create(tiny_server.client(), endpoint, user="someone", extra_body={**off, **metadata})
    assert reply.usage.completion_tokens == 2
    nulls = unsupported(endpoint, dict.fromkeys(UNSUPPORTED_FIELDS))
    assert create(tiny_server.client(), endpoint, extra_body=nulls).usage.completion_tokens == 2


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_unknown_field_is_a_400_not_ignored(tiny_server, endpoint):
    with pytest.raises(openai.BadRequestError) as caught:
        create(tiny_server.client(), endpoint, extra_body={"max_token": 50})
    assert caught.value.body["param"] == "max_token"
    assert caught.value.body["message"] == "'max_token' is not supported by kvserve: this endpoint has no such field"


def test_stream_options_follow_the_same_rule(tiny_server):
    client, options = tiny_server.client(), {"include_usage": True, "include_usages": True}
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, "chat", stream=True, stream_options=options)
    assert caught.value.body["param"] == "stream_options.include_usages"
    assert caught.value.body["message"].startswith("'stream_options.include_usages' is not supported")
    chunks = list(create(client, "chat", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


def test_a_field_of_the_other_endpoint_is_refused(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        create(tiny_server.client(), "completions", extra_body={"max_completion_tokens": 4})
    assert caught.value.body["param"] == "max_completion_tokens"


def test_the_off_value_is_matched_with_its_json_type(tiny_server):
    """``0 == False`` in Python: ``"store": 0`` is not ``false`` and is refused."""
    body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, "store": 0}
    response = httpx.post(tiny_server.base_url + "/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "store"
    assert "accepted only as null or false" in response.json()["error"]["message"]


def test_add_special_tokens_false_leaves_the_bos_out_of_a_completion_prompt(tiny_server):
    client = tiny_server.client()
    with_bos = client.completions.create(model=TINY_NAME, prompt="hello there", max_tokens=1)
    bare = client.completions.create(
        model=TINY_NAME, prompt="hello there", max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert bare.usage.prompt_tokens == with_bos.usage.prompt_tokens - 1


def test_cached_tokens_count_the_prefix_cache_hits(tiny_server):
    """The first request computes its whole prompt; the same prompt again reuses its full blocks."""
    client = tiny_server.client()
    prompt = "the cat sat on the mat and then the cat ran to the other room. " * 3
    first = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < again.usage.prompt_tokens


def test_cached_tokens_in_chat_and_in_the_streamed_usage_chunk(tiny_server):
    client = tiny_server.client()
    messages = [{"role": "user", "content": "tell me about the thing in the other room, then the end. " * 3}]
    kwargs = dict(model=TINY_NAME, messages=messages, max_tokens=2)
    first = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0
    body = {"model": TINY_NAME, "prompt": [5] * 40, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    usage = []
    for _ in range(2):
        streamed = httpx.post(tiny_server.base_url + "/completions", json=body, timeout=30)
        lines = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
        usage.append(json.loads(lines[-1])["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert usage == [0, 32]  # the two full blocks of a 40-token prompt


def test_cached_tokens_count_prompt_cache_modules_on_first_use(tiny_server):
    """A PML prompt's modules were encoded when its schema was registered: served from the cache at once."""
    schema = '<schema name="facts"><module name="doc">' + "the cat sat on the mat. " * 6 + "</module></schema>"
    assert httpx.post(tiny_server.base_url + "/schemas", json={"pml": schema}, timeout=30).status_code == 200
    prompt = '<prompt schema="facts"><doc/><user>where did the cat sit?</user></prompt>'
    reply = tiny_server.client().completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2)
    assert 0 < reply.usage.prompt_tokens_details.cached_tokens < reply.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(tiny_server, stream):
    client = tiny_server.client()
    kwargs = dict(model=TINY_NAME, prompt="the cat sat on", max_tokens=24, temperature=0)
    free = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = free[6:9]
    end = free.index(stop)

    def text(**extra) -> str:
        body = {"ignore_eos": True, **extra}
        if not stream:
            choice = client.completions.create(**kwargs, stop=[stop], extra_body=body).choices[0]
            assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
            return choice.text
        chunks = client.completions.create(**kwargs, stop=[stop], extra_body=body, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    assert text() == free[:end]
    assert text(include_stop_str_in_output=True) == free[: end + len(stop)]


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_server):
    client = tiny_server.client()
    long = [5 + i % 250 for i in range(2000)]  # twice the 1024-token context
    kwargs = dict(model=TINY_NAME, max_tokens=6, temperature=0)
    cut = client.completions.create(prompt=long, echo=True, extra_body={"truncate_prompt_tokens": 100}, **kwargs)
    tail = client.completions.create(prompt=long[-100:], echo=True, **kwargs)
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].text == tail.choices[0].text
    text = "the cat sat on the mat. " * 20
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": text}], extra_body={"truncate_prompt_tokens": 12}, **kwargs
    )
    assert chat.usage.prompt_tokens == 12


@pytest.mark.parametrize(
    ("keep", "prompt", "words"),
    [
        (0, "hi", "from 1 to 1023"),
        (1024, "hi", "from 1 to 1023"),
        (8, '<prompt schema="none"><user>hi</user></prompt>', "cannot cut a PML prompt"),
    ],
)
def test_truncate_prompt_tokens_out_of_range_is_a_400(tiny_server, keep, prompt, words):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().completions.create(
            model=TINY_NAME, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": keep}
        )
    assert caught.value.body["param"] == "truncate_prompt_tokens" and words in caught.value.body["message"]


def test_min_tokens_lets_no_stop_end_a_choice_early(tiny_server):
    client = tiny_server.client()
    kwargs = dict(model=TINY_NAME, prompt="the cat sat on", max_tokens=8, temperature=0)
    stop = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text[:1]
    early = client.completions.create(**kwargs, stop=[stop], extra_body={"ignore_eos": True})
    late = client.completions.create(**kwargs, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 3})
    assert early.usage.completion_tokens == 1 and early.choices[0].text == ""
    assert late.usage.completion_tokens > 3 and late.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**kwargs, extra_body={"min_tokens": 9})
    assert caught.value.body["param"] == "min_tokens" and "[0, 8], got 9" in caught.value.body["message"]


def test_logit_bias_and_allowed_token_ids_steer_both_endpoints(tiny_server):
    client, decode = tiny_server.client(), tiny_server.engine.engine.tokenizer.decode
    forced = client.completions.create(
        model=TINY_NAME,
        prompt="the cat",
        max_tokens=4,
        temperature=0,
        logit_bias={"7": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == decode([7] * 4)
    chat = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_tokens=4, temperature=0.8, seed=1,
        extra_body={"allowed_token_ids": [9], "ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == decode([9] * 4)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"300": 1}}, "logit_bias", "[300] are outside the model's vocabulary of 300"),
        ({"logit_bias": {"5": 200}}, "logit_bias", "[-100, 100], got 200"),
        ({"allowed_token_ids": [300]}, "allowed_token_ids", "[300] are outside"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ],
)
def test_bad_logit_bias_and_allowed_token_ids_are_a_400(tiny_server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        create(tiny_server.client(), "completions", extra_body=extra)
    assert caught.value.body["param"] == param and words in caught.value.body["message"]

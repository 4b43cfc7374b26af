"""Bad requests get OpenAI-style errors naming the field, and never disturb the engine.

Every case is followed by a good request that must still succeed. A second server with an API key
and ``max_queue=1`` covers 401 and 503 (with ``Retry-After``).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.server.async_engine import AsyncEngine
from tests.server.conftest import TINY_NAME, RunningServer, start_server, tiny_engine, wait_until

API_KEY = "sk-kvserve-test"
CHAT = "/chat/completions"
COMPLETIONS = "/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def good_request_succeeds(server: RunningServer) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    body = {"model": TINY_NAME, "prompt": "hello", "max_tokens": 2}
    response = httpx.post(server.base_url + COMPLETIONS, json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


BAD_BODIES = [
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", id="max_tokens-wrong-type"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature", id="temperature-wrong-type"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": [2]}, "n", id="n-wrong-type"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": "10"}, "max_tokens", id="max_tokens-numeric-string"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 1.5}, "n", id="n-float"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream", id="stream-wrong-type"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop": 7}, "stop", id="stop-wrong-type"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options", id="so"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "top_k": 0}, "top_k", id="top_k-0"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix", id="suffix-unsupported"),
    pytest.param(COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt", id="prompt-wrong-type"),
    pytest.param(COMPLETIONS, {"max_tokens": 4}, "prompt", id="prompt-missing"),
    pytest.param(COMPLETIONS, {"prompt": []}, "prompt", id="prompt-empty-list"),
    pytest.param(COMPLETIONS, {"prompt": [5] * 1100}, "prompt", id="prompt-longer-than-context"),
    pytest.param(COMPLETIONS, {"prompt": [5, 300]}, "prompt", id="token-outside-vocabulary"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens", id="max_tokens-0"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, "max_tokens", id="max_tokens-negative"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 65}, "n", id="n-over-64"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 0}, "n", id="n-0"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", id="best_of-below-n"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", id="logprobs-21"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs", id="logprobs-negative"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p", id="top_p-0"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stop": ""}, "stop", id="stop-empty"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "seed": 2**70}, "seed", id="seed-too-big"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "stream": True, "best_of": 2}, "best_of", id="stream-best_of"),
    pytest.param(CHAT, {"messages": []}, "messages", id="messages-empty"),
    pytest.param(CHAT, {"messages": [{"content": "hi"}]}, "messages", id="message-without-role"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages", id="content-wrong-type"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "x " * 1100}]}, "messages", id="chat-too-long"),
    pytest.param(CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens", id="mct-0"),
    pytest.param(CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top-21"),
    pytest.param(CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", id="top-without-logprobs"),
    pytest.param(CHAT, {"messages": MESSAGES, "logprobs": "maybe"}, "logprobs", id="logprobs-wrong-type"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field(tiny_server, path, body, param):
    response = httpx.post(tiny_server.base_url + path, json={"model": TINY_NAME, **body}, timeout=30)
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    good_request_succeeds(tiny_server)


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"prompt": "hi",}'])
def test_malformed_json_is_a_400(tiny_server, content):
    response = httpx.post(
        tiny_server.base_url + COMPLETIONS, content=content, headers={"Content-Type": "application/json"}
    )
    assert "not valid JSON" in error_of(response, 400)["message"]
    good_request_succeeds(tiny_server)


def test_a_json_array_body_is_a_400(tiny_server):
    response = httpx.post(tiny_server.base_url + COMPLETIONS, json=["hi"])
    assert "JSON object" in error_of(response, 400)["message"]


def test_the_openai_client_sees_bad_requests_as_BadRequestError(tiny_server):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, n=100)
    assert caught.value.body["param"] == "n"
    good_request_succeeds(tiny_server)


def test_unknown_model_is_a_404(tiny_server):
    with pytest.raises(openai.NotFoundError) as caught:
        tiny_server.client().completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model" and "gpt-5" in caught.value.body["message"]
    response = httpx.post(tiny_server.base_url + CHAT, json={"model": "nope", "messages": MESSAGES})
    assert error_of(response, 404)["code"] == "model_not_found"
    good_request_succeeds(tiny_server)


def test_unknown_route_and_wrong_method_use_the_error_shape(tiny_server):
    error_of(httpx.get(tiny_server.base_url + "/nothing"), 404)
    error_of(httpx.get(tiny_server.base_url + COMPLETIONS), 405)


@pytest.mark.slow
def test_a_failing_engine_step_fails_its_requests_with_500_and_the_engine_keeps_serving(tiny_server, monkeypatch):
    engine = tiny_server.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_once)
    with pytest.raises(openai.InternalServerError) as caught:
        tiny_server.client().completions.create(model=TINY_NAME, prompt="hi", max_tokens=4)
    assert "injected fault" in caught.value.body["message"]
    assert tiny_server.engine.num_step_errors == 1
    good_request_succeeds(tiny_server)
    # A failure in the middle of a stream arrives as an error event.
    calls["n"] = -5  # fail on the 6th step from now: after the first tokens
    stream = tiny_server.client().completions.create(
        model=TINY_NAME, prompt="hi", max_tokens=50, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError, match="injected fault"):
        list(stream)
    assert tiny_server.engine.num_step_errors == 2
    good_request_succeeds(tiny_server)
    wait_until(lambda: tiny_server.metrics()["kvserve:kv_cache_usage_perc"] == 0)


# ----- API key and queue bound -----


@pytest.fixture(scope="module")
def guarded(tiny_folder, tiny_loaded):
    running = start_server(tiny_engine(tiny_folder, tiny_loaded), api_key=API_KEY, max_queue=1)
    yield running
    running.stop()


@pytest.mark.slow
def test_missing_or_wrong_api_key_is_a_401(guarded):
    url = guarded.base_url + COMPLETIONS
    body = {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}
    assert error_of(httpx.post(url, json=body), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
    assert error_of(httpx.post(url, json=body, headers={"Authorization": API_KEY}), 401)  # no "Bearer"
    assert error_of(httpx.get(guarded.base_url + "/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(guarded.url + "/health").status_code == 200  # health stays open
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    assert guarded.client().models.list().data[0].id == TINY_NAME
    good_request_succeeds(guarded)


def test_a_full_queue_is_a_503_with_retry_after(guarded):
    client = guarded.client()
    stream = client.completions.create(
        model=TINY_NAME, prompt="hold the queue", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the long request is running: the queue (max 1) is full
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(guarded.base_url + CHAT, json={"messages": MESSAGES}, headers=headers)
    error = error_of(response, 503)
    assert int(response.headers["Retry-After"]) >= 1
    assert "max-queue" in error["message"]
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2)
    assert caught.value.status_code == 503
    stream.close()  # the client goes away: the request is aborted and its place freed
    wait_until(lambda: guarded.engine.num_active == 0)
    good_request_succeeds(guarded)


def test_max_queue_must_be_positive(tiny_server):
    with pytest.raises(ValueError, match="max_queue"):
        AsyncEngine(tiny_server.engine.engine, max_queue=0)

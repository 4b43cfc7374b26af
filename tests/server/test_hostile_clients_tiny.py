"""A hostile or careless client cannot disturb the others: body size, tokenising off the event loop, stop
strings, stop token ids and multi-prompt requests larger than the queue.

Every test runs against a real uvicorn server on loopback (tiny random model).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from kvserve.sampling.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import TINY_NAME, start_server, tiny_engine
from tests.tiny_models import VOCAB_SIZE

COMPLETIONS = "/completions"
CHAT = "/chat/completions"
LIMIT_TEXT = f"{DEFAULT_MAX_REQUEST_BYTES:,} bytes (--max-request-bytes)"


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]


def good_request_succeeds(url: str) -> None:
    body = {"model": TINY_NAME, "prompt": "hello", "max_tokens": 2}
    response = httpx.post(url + COMPLETIONS, json=body, timeout=30)
    assert response.status_code == 200, response.text


# ----- item 1: one large request does not stall the server -----


@pytest.mark.slow
@pytest.mark.parametrize(("path", "param"), [(COMPLETIONS, "prompt"), (CHAT, "messages")])
def test_health_stays_responsive_while_a_large_prompt_is_tokenised(tiny_server, path, param):
    """A prompt just under the body limit takes seconds to tokenise (then fails: longer than the context);
    meanwhile /health answers at once, because tokenising runs off the event loop and releases the GIL."""
    text = "the quick brown fox jumps over the lazy dog. " * (DEFAULT_MAX_REQUEST_BYTES // 46)
    prompt = {"prompt": text} if path == COMPLETIONS else {"messages": [{"role": "user", "content": text}]}
    result: dict = {}

    def big() -> None:
        body = {"model": TINY_NAME, **prompt, "max_tokens": 1}
        result["response"] = httpx.post(tiny_server.base_url + path, json=body, timeout=120)

    thread = threading.Thread(target=big)
    thread.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            sent = time.monotonic()
            assert client.get(tiny_server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - sent)
            time.sleep(0.05)
    thread.join()
    assert error_of(result["response"], 400)["param"] == param  # longer than the 1024-token context
    assert max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s while a prompt was tokenised"
    assert len(latencies) >= 3, "the large prompt was answered too soon to test anything"
    good_request_succeeds(tiny_server.base_url)


def test_a_body_over_the_limit_is_a_413_naming_size_and_limit(tiny_server):
    body = b'{"prompt": "' + b"a" * DEFAULT_MAX_REQUEST_BYTES + b'"}'
    response = httpx.post(tiny_server.base_url + COMPLETIONS, content=body, timeout=60)
    error = error_of(response, 413)
    assert f"{len(body):,} bytes" in error["message"] and LIMIT_TEXT in error["message"]
    good_request_succeeds(tiny_server.base_url)


def test_a_chunked_body_over_the_limit_is_a_413(tiny_server):
    """No Content-Length: the bytes are counted as they arrive."""
    piece = b"a" * (1 << 16)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // len(piece) + 1):
            yield piece
        yield b'"}'

    response = httpx.post(tiny_server.base_url + COMPLETIONS, content=chunks(), timeout=60)
    error = error_of(response, 413)
    assert "received so far" in error["message"] and LIMIT_TEXT in error["message"]
    good_request_succeeds(tiny_server.base_url)


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(tiny_server):
    """The 413 comes back while the client has sent only the headers of a 100 MB body."""
    host, port = tiny_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Content-Length: 100000000\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"100,000,000 bytes" in reply and LIMIT_TEXT.encode() in reply


# ----- item 2: stop strings are bounded -----


@pytest.mark.parametrize(
    ("stop", "limit"),
    [
        pytest.param([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS}", id="too-many"),
        pytest.param(["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters", id="too-long"),
    ],
)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_too_many_or_too_long_stop_strings_are_a_400(tiny_server, path, stop, limit):
    prompt = {"prompt": "hello"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hello"}]}
    body = {"model": TINY_NAME, **prompt, "max_tokens": 2, "stop": stop}
    error = error_of(httpx.post(tiny_server.base_url + path, json=body, timeout=30), 400)
    assert error["param"] == "stop" and limit in error["message"]
    good_request_succeeds(tiny_server.base_url)


def test_stop_strings_at_the_limits_still_stop(tiny_server):
    """The most and longest stop strings allowed are accepted, and the one the text reaches ends it."""
    client = tiny_server.client()
    kwargs = dict(model=TINY_NAME, prompt="one two three", max_tokens=24, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    text = client.completions.create(**kwargs).choices[0].text
    target = text[len(text) // 2 : len(text) // 2 + 2]
    assert target.strip(), text
    fillers = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS - 1)]  # never generated
    for stream in (False, True):
        response = client.completions.create(**kwargs, stop=[*fillers, target], stream=stream)
        chunks = list(response) if stream else [response]
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        assert got == text[: text.index(target)]
        assert chunks[-1].choices[0].finish_reason == "stop"


# ----- item 10 (part): stop token ids must be in the vocabulary -----


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1, 10**9])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(tiny_server, path, bad):
    prompt = {"prompt": "hello"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hello"}]}
    body = {"model": TINY_NAME, **prompt, "max_tokens": 2, "stop_token_ids": [5, bad]}
    error = error_of(httpx.post(tiny_server.base_url + path, json=body, timeout=30), 400)
    assert error["param"] == "stop_token_ids"
    assert str(bad) in error["message"] and f"vocabulary of {VOCAB_SIZE} tokens" in error["message"]
    good_request_succeeds(tiny_server.base_url)


# ----- item 4: a request that can never fit the queue -----


@pytest.fixture(scope="module")
def small_queue_server(tiny_folder, tiny_loaded):
    running = start_server(tiny_engine(tiny_folder, tiny_loaded), max_queue=2)
    yield running
    running.stop()


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_503(small_queue_server):
    url = small_queue_server.base_url
    body = {"model": TINY_NAME, "prompt": ["a", "b", "c"], "max_tokens": 2}
    response = httpx.post(url + COMPLETIONS, json=body, timeout=30)
    error = error_of(response, 400)
    assert "retry-after" not in response.headers
    assert error["param"] == "prompt" and "3 prompts" in error["message"] and "at most 2" in error["message"]
    response = httpx.post(url + COMPLETIONS, json={**body, "prompt": ["a", "b"]}, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 2

"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` on a real uvicorn server (tiny random model).

The tokenizer routes answer what the served model's tokenizer says, count a chat as the chat endpoint
does, refuse ids outside the vocabulary with a 400 naming them, and need the API key as ``/v1`` does.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import kvserve
from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import TINY_NAME, start_server, tiny_engine
from tests.tiny_models import BOS_ID, VOCAB_SIZE

TEXT = "the quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def test_tokenize_a_prompt_as_the_tokenizer_does(tiny_server):
    tokenizer = tiny_server.engine.engine.tokenizer
    answer = post(tiny_server, "/tokenize", {"model": TINY_NAME, "prompt": TEXT}).json()
    assert answer["tokens"] == tokenizer.encode(TEXT) and answer["tokens"][0] == BOS_ID
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 1024
    bare = post(tiny_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert bare.json()["tokens"] == answer["tokens"][1:]  # no BOS
    assert bare.json()["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"][1:])
    assert "".join(bare.json()["token_strs"]).replace("Ġ", " ") == TEXT


def test_tokenize_messages_counts_what_the_chat_endpoint_sends(tiny_server):
    answer = post(tiny_server, "/tokenize", {"model": TINY_NAME, "messages": MESSAGES}).json()
    reply = tiny_server.client().chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=1)
    assert answer["count"] == reply.usage.prompt_tokens == len(answer["tokens"])
    assert answer["tokens"] == tiny_server.engine.engine.tokenizer.encode_chat(MESSAGES)
    without = post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert answer["tokens"][: without["count"]] == without["tokens"] and without["count"] < answer["count"]


def test_detokenize_inverts_tokenize_and_refuses_ids_outside_the_vocabulary(tiny_server):
    ids = post(tiny_server, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    assert post(tiny_server, "/detokenize", {"model": TINY_NAME, "tokens": ids}).json() == {"prompt": "<s>" + TEXT}
    response = post(tiny_server, "/detokenize", {"tokens": [5, VOCAB_SIZE, -1]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tokens" and f"[{VOCAB_SIZE}, -1]" in error["message"]
    assert f"vocabulary of {VOCAB_SIZE} tokens" in error["message"]
    assert post(tiny_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"add_special_tokens": True}, 400, "prompt"),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": TEXT, "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens"),
        ("/tokenize", {"prompt": TEXT, "model": "gpt-5"}, 404, "model"),
        ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(tiny_server, path, body, status, param):
    response = post(tiny_server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert post(tiny_server, "/tokenize", {"prompt": TEXT}).status_code == 200


def test_version_is_the_package_version(tiny_server):
    assert httpx.get(tiny_server.url + "/version").json() == {"version": kvserve.__version__}


def test_the_tokenizer_routes_need_the_api_key_and_version_does_not(tiny_folder, tiny_loaded):
    server = start_server(tiny_engine(tiny_folder, tiny_loaded), api_key="sk-tokenize")
    try:
        for path, body in (("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [5, 6]})):
            assert post(server, path, body).status_code == 401
            assert post(server, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert post(server, path, body, headers={"Authorization": "Bearer sk-tokenize"}).status_code == 200
        assert httpx.get(server.url + "/version").status_code == 200
    finally:
        server.stop()


@pytest.mark.slow
def test_health_stays_responsive_while_a_large_prompt_is_tokenised(tiny_server):
    text = "the quick brown fox jumps over the lazy dog. " * (DEFAULT_MAX_REQUEST_BYTES // 4 // 46)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(response=post(tiny_server, "/tokenize", {"prompt": text})))
    thread.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            sent = time.monotonic()
            assert client.get(tiny_server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - sent)
            time.sleep(0.05)
    thread.join()
    assert result["response"].json()["tokens"] == tiny_server.engine.engine.tokenizer.encode(text)
    assert max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s while a prompt was tokenised"
    assert len(latencies) >= 3, "the large prompt was answered too soon to test anything"

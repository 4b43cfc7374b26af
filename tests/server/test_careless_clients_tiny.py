"""What a careless client sends, against a real server on loopback (tiny random model): chat messages with
roles or contents the API does not take, schema names no URL can reach, bad PML, and a client that hangs
up before its answer. Each gets a 400 naming the field, or nothing in the log, and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import TINY_NAME, wait_until

SCHEMA = '<schema name="{name}"><module name="m">Some text to cache.</module></schema>'


def chat_error(server, messages: list[dict]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2)
    return caught.value


def post_schema(server, name: str) -> httpx.Response:
    return httpx.post(server.base_url + "/schemas", json={"pml": SCHEMA.format(name=name)}, timeout=30)


# ----- chat messages -----


def test_an_unknown_role_is_a_400_naming_the_message(tiny_server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "wizard", "content": "abracadabra"}]  # fmt: skip
    error = chat_error(tiny_server, messages)
    assert error.param == "messages[2].role"
    assert "messages[2].role: 'wizard' is not one of system, developer, user, assistant, tool" in error.message


def test_null_content_is_a_400_except_for_an_assistant(tiny_server):
    error = chat_error(tiny_server, [{"role": "system", "content": "x"}, {"role": "user", "content": None}])
    assert error.param == "messages[1].content" and "a user message needs content" in error.message
    # OpenAI's assistant turn that held only tool calls has null content: it renders as an empty turn.
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]  # fmt: skip
    ok = tiny_server.client().chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_a_developer_message_renders_as_a_system_message(tiny_server):
    def chat(role: str):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hello"}]
        return tiny_server.client().chat.completions.create(
            model=TINY_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )

    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = len(tiny_server.engine.engine.tokenizer.encode_chat(as_system))
    developer, system = chat("developer"), chat("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens == expected
    assert developer.choices[0].message.content == system.choices[0].message.content


# ----- schema names -----


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "x" * 65, "sp ace", "caf\u00e9"])
def test_a_schema_name_outside_the_safe_set_is_a_400_naming_the_rule(tiny_server, name):
    response = post_schema(tiny_server, name)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "pml"
    assert "is not allowed: a schema name is 1 to 64 of A-Z a-z 0-9 . _ -" in error["message"]
    listed = httpx.get(tiny_server.base_url + "/schemas").json()["data"]
    assert name not in [s["name"] for s in listed]


def test_a_safe_schema_name_can_be_read_and_deleted(tiny_server):
    name = "Team_1.docs-v2"
    assert post_schema(tiny_server, name).status_code == 200
    assert httpx.get(f"{tiny_server.base_url}/schemas/{name}").json()["name"] == name
    assert httpx.delete(f"{tiny_server.base_url}/schemas/{name}").json()["deleted"] is True
    assert not [key for key in tiny_server.engine.engine.prompt_cache.store.modules if key[0] == name]  # memory freed


@pytest.mark.slow
def test_errors_name_only_the_schema_asked_for(tiny_server):
    assert post_schema(tiny_server, "someone-elses").status_code == 200
    try:
        for response in (httpx.get(tiny_server.base_url + "/schemas/mine"),
                         httpx.delete(tiny_server.base_url + "/schemas/mine")):  # fmt: skip
            assert response.status_code == 404
            message = response.json()["error"]["message"]
            assert "'mine'" in message and "someone-elses" not in message
        with pytest.raises(openai.BadRequestError) as caught:
            tiny_server.client().completions.create(model=TINY_NAME, prompt='<prompt schema="mine">hi</prompt>')
        assert "unknown schema 'mine'" in caught.value.message and "someone-elses" not in caught.value.message
    finally:
        httpx.delete(tiny_server.base_url + "/schemas/someone-elses")


def test_a_prompt_naming_an_impossible_schema_says_why(tiny_server):
    with pytest.raises(openai.BadRequestError, match="schema name 'a/b' is not allowed"):
        tiny_server.client().completions.create(model=TINY_NAME, prompt='<prompt schema="a/b">hi</prompt>')


@pytest.mark.slow
def test_serve_refuses_a_schema_file_with_an_unsafe_name(tiny_folder, tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text(SCHEMA.format(name="a/b"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "kvserve", "serve", "--model", str(tiny_folder), "--port", str(port),
        "--schema", str(path), "--kv-cache-memory", "8MiB", "--max-num-seqs", "4", "--threads", "1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None:  # a server that comes up has taken the schema: stop waiting
            assert time.monotonic() < deadline, "kvserve serve neither refused the schema nor came up"
            with contextlib.suppress(httpx.TransportError):
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code != 200, "it came up"
            time.sleep(0.2)
    finally:
        process.kill()
        stderr = process.communicate()[1]
    assert process.returncode == 2, stderr
    assert f"schema file {path}" in stderr and "schema name 'a/b' is not allowed" in stderr


# ----- PML errors name their field -----


def test_pml_errors_name_the_field_that_held_the_prompt(tiny_server):
    assert post_schema(tiny_server, "pml-param").status_code == 200
    bad = '<prompt schema="pml-param"><nope/>hi</prompt>'
    try:
        with pytest.raises(openai.BadRequestError, match="no module 'nope'") as caught:
            tiny_server.client().completions.create(model=TINY_NAME, prompt=bad, max_tokens=2)
        assert caught.value.param == "prompt"
        error = chat_error(tiny_server, [{"role": "user", "content": bad}])
        assert error.param == "messages[0].content" and "no module 'nope'" in error.message
    finally:
        httpx.delete(tiny_server.base_url + "/schemas/pml-param")


# ----- a client that hangs up -----


def hang_up_during(server, body: dict) -> None:
    """Send a non-streaming request on a raw socket and close it once the engine is running it."""
    payload = json.dumps(body).encode()
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines.append(f"Content-Length: {len(payload)}")
    head = "".join(line + "\r\n" for line in lines)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + payload)
        wait_until(lambda: server.engine.engine.has_unfinished_requests())
    wait_until(lambda: server.engine.num_active == 0 and not server.engine.engine.has_unfinished_requests())


@pytest.mark.slow
def test_a_client_that_hangs_up_leaves_nothing_in_the_log(tiny_server, caplog):
    """The request is aborted, and asyncio logs no never-retrieved exception or CancelledError traceback."""
    caplog.set_level(logging.DEBUG)
    for _ in range(2):
        hang_up_during(tiny_server, {"model": TINY_NAME, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True})
    gc.collect()  # an unread future's exception is logged when the future is collected
    ok = tiny_server.client().completions.create(model=TINY_NAME, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy]

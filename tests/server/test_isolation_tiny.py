"""Isolation over HTTP: ``cache_salt`` on completions and chat, and a schema namespace per API key.

A real server with two API keys on loopback, driven with the ``openai`` client. Prefix-cache hits are read
from ``usage.prompt_tokens_details.cached_tokens``: 0 across salts and across keys, more than 0 for the same
salt and key (so each check can fail). Key B sees none of key A's schemas: GET, DELETE and PML prompts get
what a missing schema gets; B's own schema of the same name leaves A's alone, and A's modules give B's
encoding no prefix hit.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.core.isolation import MAX_CACHE_SALT_CHARS
from kvserve.server.api_keys import read_api_keys
from tests.server.conftest import TINY_NAME, TINY_OPTIONS, start_server, tiny_engine

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
BLOCK = TINY_OPTIONS["block_size"]
PROMPT = list(range(10, 10 + 6 * BLOCK))  # six full blocks
SCHEMA = """<schema name="s">the cat sat on the mat and then it ran off to the door and out into the garden
  <module name="doc">one two three four five six seven eight nine ten eleven twelve thirteen fourteen</module>
</schema>"""
OTHER_SCHEMA = '<schema name="s">a different schema <module name="doc">with the same name</module></schema>'
PML = '<prompt schema="s"><doc/> and so on and so forth, what next</prompt>'


@pytest.fixture(scope="module")
def server(tiny_folder, tiny_loaded):
    running = start_server(tiny_engine(tiny_folder, tiny_loaded), api_key=[KEY_A, KEY_B])
    yield running
    running.stop()


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def cached(server, key: str, prompt, salt: str | None = None, chat: bool = False) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    if chat:
        messages = [{"role": "user", "content": prompt}]
        response = client(server, key).chat.completions.create(
            model=TINY_NAME, messages=messages, max_tokens=1, extra_body=extra
        )
    else:
        response = client(server, key).completions.create(
            model=TINY_NAME, prompt=prompt, max_tokens=1, extra_body=extra
        )
    return response.usage.prompt_tokens_details.cached_tokens


def schemas(server, key: str, method: str = "GET", name: str = "", pml: str | None = None) -> httpx.Response:
    url = server.base_url + "/schemas" + (f"/{name}" if name else "")
    body = {"json": {"pml": pml}} if pml is not None else {}
    return httpx.request(method, url, headers={"Authorization": f"Bearer {key}"}, timeout=60, **body)


@pytest.mark.slow
def test_a_salted_request_gets_no_hit_from_another_salt(server):
    prompt = [7, *PROMPT]
    assert cached(server, KEY_A, prompt, "alice") == 0
    assert cached(server, KEY_A, prompt, "bob") == 0
    assert cached(server, KEY_A, prompt) == 0
    assert cached(server, KEY_A, prompt, "alice") == len(PROMPT) // BLOCK * BLOCK  # its own salt: a hit
    text = "a chat that is long enough to fill several blocks of the prefix cache, twice over at least " * 2
    assert cached(server, KEY_A, text, "alice", chat=True) == 0
    assert cached(server, KEY_A, text, "bob", chat=True) == 0
    assert cached(server, KEY_A, text, "alice", chat=True) > 0


def test_requests_of_two_keys_share_no_prefix_block(server):
    prompt = [8, *PROMPT]
    assert cached(server, KEY_A, prompt) == 0
    assert cached(server, KEY_B, prompt) == 0
    assert cached(server, KEY_B, prompt, "same") == 0
    assert cached(server, KEY_A, prompt, "same") == 0
    assert cached(server, KEY_B, prompt) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("salt", "message"),
    [("", "cache_salt must not be empty"), ("x" * (MAX_CACHE_SALT_CHARS + 1), "at most 256 are allowed")],
)
def test_a_bad_salt_is_a_400_naming_it(server, salt, message):
    with pytest.raises(openai.BadRequestError) as info:
        client(server, KEY_A).completions.create(
            model=TINY_NAME, prompt="hi", max_tokens=1, extra_body={"cache_salt": salt}
        )
    assert info.value.body["param"] == "cache_salt" and message in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client(server, KEY_A).completions.create(
            model=TINY_NAME, prompt="hi", max_tokens=1, extra_body={"cache_salt": 5}
        )
    assert info.value.body["param"] == "cache_salt"
    assert cached(server, KEY_A, "still serving") == 0


@pytest.mark.slow
def test_each_key_has_its_own_schemas(server):
    created = schemas(server, KEY_A, "POST", pml=SCHEMA)
    assert created.status_code == 200 and created.json()["name"] == "s"
    missing = schemas(server, KEY_B, name="nobody")
    for method in ("GET", "DELETE"):
        other = schemas(server, KEY_B, method, "s")
        assert other.status_code == 404
        assert other.json()["error"] == {**missing.json()["error"], "message": "no schema named 's' is registered"}
    assert schemas(server, KEY_B).json()["data"] == []
    assert [s["name"] for s in schemas(server, KEY_A).json()["data"]] == ["s"]
    with pytest.raises(openai.BadRequestError, match="unknown schema 's'"):  # as for a schema nobody registered
        client(server, KEY_B).completions.create(model=TINY_NAME, prompt=PML, max_tokens=1)

    engine = server.engine.engine
    hits_before = engine.kv.usage().prefix_hit_tokens
    assert schemas(server, KEY_B, "POST", pml=SCHEMA).status_code == 200  # the same text: B's own copy
    assert engine.kv.usage().prefix_hit_tokens == hits_before  # 0 hits from A's module blocks
    assert schemas(server, KEY_B, "DELETE", name="s").status_code == 200
    assert schemas(server, KEY_B, "POST", pml=OTHER_SCHEMA).status_code == 200  # B's own "s"
    assert schemas(server, KEY_A, name="s").json()["modules"] == created.json()["modules"]  # A's untouched
    a_first, b_first = cached(server, KEY_A, PML), cached(server, KEY_B, PML)
    assert cached(server, KEY_A, PML) > a_first  # A's PML prompt still works, and hits its own blocks
    assert b_first < a_first  # B's prompt imports B's shorter module, none of A's
    with pytest.raises(openai.BadRequestError) as info:
        client(server, KEY_A).completions.create(
            model=TINY_NAME, prompt=PML, max_tokens=1, extra_body={"cache_salt": "alice"}
        )
    assert info.value.body["param"] == "cache_salt" and "Prompt Cache prompt" in info.value.body["message"]
    assert schemas(server, KEY_A, "DELETE", "s").status_code == 200
    assert schemas(server, KEY_B, name="s").status_code == 200


def test_a_wrong_key_is_still_a_401(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-nobody").models.list()
    assert client(server, KEY_B).models.list().data[0].id == TINY_NAME


def test_keys_come_from_options_a_file_or_the_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nsk-one\n\n  sk-two  \n# sk-commented\nsk-one\n")
    assert read_api_keys(["sk-zero"], str(keys_file), "sk-env") == ["sk-zero", "sk-one", "sk-two"]
    assert read_api_keys(None, None, "sk-env") == ["sk-env"]
    assert read_api_keys(None, None, None) == [] and read_api_keys(None, None, "") == []
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        read_api_keys(None, str(tmp_path / "empty"), None)
    (tmp_path / "spaced").write_text("sk-secret with space\n")
    with pytest.raises(ValueError, match="line 1: an API key must be") as info:
        read_api_keys(None, str(tmp_path / "spaced"), None)
    assert "secret" not in str(info.value).replace(str(tmp_path), "")  # errors never show a key
    with pytest.raises(ValueError, match="cannot read --api-key-file"):
        read_api_keys(None, str(tmp_path / "absent"), None)

"""Prompt Cache over HTTP on a tiny random model: /v1/schemas with httpx, PML prompts with the ``openai`` client.

A PML completion over the server equals the offline engine's greedy output for the same prompt; bad
schemas and prompts get a 400 naming the problem, unknown schemas a 404, and the server keeps serving.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.prompt_cache.store import ModuleRoomError
from kvserve.sampling.sampling_params import SamplingParams
from tests.server.conftest import TINY_NAME, start_server, tiny_engine

SCHEMA = """<schema name="trip">
  <system>You plan trips.</system>
  <module name="plan">Plan <param name="days" len="4"/> days in <union><module name="paris">Paris</module>
  <module name="rome">Rome</module></union>.</module>
</schema>"""
PROMPT = '<prompt schema="trip"><plan days="3"><rome/></plan><user>What first?</user></prompt>'


@pytest.fixture(scope="module")
def server(tiny_folder, tiny_loaded):
    running = start_server(tiny_engine(tiny_folder, tiny_loaded))
    yield running
    running.stop()


def post_schema(server, pml: str) -> httpx.Response:
    return httpx.post(server.base_url + "/schemas", json={"pml": pml}, timeout=30)


def offline_text(tiny_folder, tiny_loaded, prompt: str, max_tokens: int) -> str:
    engine = tiny_engine(tiny_folder, tiny_loaded)
    engine.register_schema(SCHEMA)
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()  # the steps encoding the schema's modules report nothing
    return outputs[-1].outputs[0].text


@pytest.mark.slow
def test_schema_routes_register_list_get_and_delete(server):
    created = post_schema(server, SCHEMA)
    assert created.status_code == 200
    body = created.json()
    assert body["name"] == "trip" and body["modules"]["paris"]["start"] == body["modules"]["rome"]["start"]
    assert body["modules"]["plan"]["params"] == {"days": 4} and body["modules"]["rome"]["cached"]
    assert [s["name"] for s in httpx.get(server.base_url + "/schemas").json()["data"]] == ["trip"]
    assert httpx.get(server.base_url + "/schemas/trip").json()["num_positions"] == body["num_positions"]
    deleted = httpx.delete(server.base_url + "/schemas/trip")
    assert deleted.json() == {"id": "trip", "object": "schema", "deleted": True}
    missing = httpx.get(server.base_url + "/schemas/trip")
    assert missing.status_code == 404 and "no schema named 'trip'" in missing.json()["error"]["message"]
    assert httpx.delete(server.base_url + "/schemas/trip").status_code == 404


def test_metrics_count_modules_their_bytes_and_encoded_tokens(server):
    httpx.delete(server.base_url + "/schemas/trip")
    before = server.metrics()
    body = post_schema(server, SCHEMA.replace('"trip"', '"metered"')).json()  # a new name: nothing cached yet
    prompt = PROMPT.replace('"trip"', '"metered"')
    server.client().completions.create(model=TINY_NAME, prompt=prompt, max_tokens=1)  # metrics refresh after a step
    after = server.metrics()
    stored = [m for m in body["modules"].values() if m["tokens"]]
    assert after["kvserve:prompt_cache_modules"] == len(stored)
    store = server.engine.engine.prompt_cache.store
    assert after["kvserve:prompt_cache_bytes"] == store.memory_bytes() > 0
    encoded = after["kvserve:prompt_cache_encoded_tokens_total"] - before.get(
        "kvserve:prompt_cache_encoded_tokens_total", 0
    )
    modules = [m for key, m in store.modules.items() if key[0] == "metered"]  # each after its context, if any
    assert len(modules) == len(stored) and encoded == sum(m.num_tokens + len(m.context_ids) for m in modules)


def test_pml_completion_and_chat_equal_the_offline_engine(server, tiny_folder, tiny_loaded):
    assert post_schema(server, SCHEMA).status_code == 200
    client = server.client()
    completion = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert completion.choices[0].text == offline_text(tiny_folder, tiny_loaded, PROMPT, 6)
    assert completion.usage.completion_tokens == 6
    chat = client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.choices[0].message.content == completion.choices[0].text


@pytest.mark.parametrize(
    ("pml", "match"),
    [
        ("<schema name='x'><module>", "line 1: malformed XML"),
        ("<schema name='x'>\n<param name='p' len='2'/></schema>", "line 2: <param name='p'> must be inside a <module>"),
        ("<prompt schema='x'>hi</prompt>", "a schema's root must be <schema"),
    ],
    ids=["malformed", "param-outside-module", "not-a-schema"],
)
def test_bad_schemas_get_a_400_naming_the_problem(server, pml, match):
    response = post_schema(server, pml)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "pml" and match in error["message"]


def test_bad_pml_prompts_get_a_400_and_the_server_keeps_serving(server):
    assert post_schema(server, SCHEMA).status_code == 200
    client = server.client()
    for prompt, match in [
        ('<prompt schema="nope">hi</prompt>', "unknown schema 'nope'"),
        ('<prompt schema="trip"><plan days="3"><rome/><paris/></plan>hi</prompt>', "members of one <union>"),
        ('<prompt schema="trip"><plan/>hi</prompt>', "needs an argument for parameter 'days'"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2)
    ok = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_a_module_with_no_room_to_load_again_is_a_503_to_retry(server, monkeypatch):
    """A module evicted for a waiting request must be loaded again; if running requests hold the whole pool at
    that moment the server is busy, not the prompt bad: 503 with Retry-After (``openai`` retries it itself)."""
    assert post_schema(server, SCHEMA).status_code == 200
    store_type = type(server.engine.engine.prompt_cache.store)

    def full_pool(self, module):
        raise ModuleRoomError(f"no room to load module {module.key[1]!r} (3 tokens): 0 of 8 are free")

    monkeypatch.setattr(store_type, "pin", full_pool)
    client = server.client()  # no retries
    with pytest.raises(openai.APIStatusError) as busy:
        client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2)
    assert busy.value.status_code == 503 and busy.value.response.headers["retry-after"] == "1"
    assert "no room to load module" in busy.value.message
    monkeypatch.undo()
    ok = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2

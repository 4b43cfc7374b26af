"""The OpenAI API on a tiny random model, driven by the official ``openai`` client over real HTTP.

Greedy results equal the offline ``LLM`` API token for token (text, token strings, counts, logprobs);
streams concatenate to the non-streamed text; ``n`` samples, stop strings, logprobs and echo follow
OpenAI's shapes.
"""

from __future__ import annotations

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.outputs import RequestOutput
from kvserve.server.tokens import TokenTexts
from tests.server.conftest import TINY_NAME, TINY_OPTIONS

PROMPTS = ["the cat sat on the mat", "hello world", "one two three four five six seven"]
IDS_PROMPT = [298, 70, 101, 7, 260, 33, 150, 270]  # BOS + arbitrary ids
MESSAGES = [{"role": "user", "content": "hello there, how are you?"}]


@pytest.fixture(scope="module")
def llm(tiny_folder, tiny_loaded, monkeypatch_module) -> LLM:
    """The offline API on the same weights (sharing the loaded model)."""
    import kvserve.entrypoints.llm

    engine_cls = kvserve.entrypoints.llm.LLMEngine
    monkeypatch_module.setattr(kvserve.entrypoints.llm, "LLMEngine", lambda config: engine_cls(config, tiny_loaded))
    return LLM(str(tiny_folder), **TINY_OPTIONS)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def client(tiny_server):
    return tiny_server.client()


@pytest.fixture(scope="module")
def texts(tiny_loaded) -> TokenTexts:
    return TokenTexts(tiny_loaded.tokenizer)


def offline(llm: LLM, prompts, **params) -> list[RequestOutput]:
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_greedy_completions_equal_the_offline_api_token_for_token(client, llm, texts):
    prompts = [*PROMPTS, IDS_PROMPT]
    expected = offline(llm, prompts, max_tokens=24, temperature=0, logprobs=0)
    response = client.completions.create(model=TINY_NAME, prompt=prompts, max_tokens=24, temperature=0, logprobs=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice, out in zip(response.choices, expected, strict=True):
        want = out.outputs[0]
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        assert choice.logprobs.tokens == [texts.text(t) for t in want.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids, strict=True)]
        )
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.id.startswith("cmpl-") and response.object == "text_completion" and response.model == TINY_NAME


def test_greedy_chat_equals_the_offline_api(client, llm):
    (expected,) = llm.chat(MESSAGES, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    response = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"


def test_streamed_completion_concatenates_to_the_non_streamed_text(client):
    kwargs = dict(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *content, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_sends_the_role_first_then_the_content(client):
    kwargs = dict(model=TINY_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage == whole.usage


def test_n_samples_per_prompt_are_indexed_prompt_major_and_seeded(client, llm):
    params = dict(n=3, max_tokens=10, temperature=1.0, seed=11)
    expected = offline(llm, PROMPTS[:2], **params)
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS[:2], **params)
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == [o.text for out in expected for o in out.outputs]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=TINY_NAME, prompt=PROMPTS[:2], stream=True, **params):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in response.choices}


def test_chat_n_samples(client):
    response = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=3
    )
    assert [c.index for c in response.choices] == [0, 1]
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=3, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in response.choices}


def test_stop_strings_cut_the_text_streamed_or_not(client, llm):
    free = offline(llm, PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True)[0].outputs[0].text
    stop = next(s for i in range(4, len(free) - 2) if (s := free[i : i + 2]).strip() and "\ufffd" not in s)
    expected = offline(llm, PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])[0].outputs[0]
    assert expected.text == free[: free.index(stop)] and expected.finish_reason == "stop"
    kwargs = dict(model=TINY_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop)
    kwargs["extra_body"] = {"ignore_eos": True}
    response = client.completions.create(**kwargs)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_completion_logprobs_have_openai_shape(client):
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    n = response.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and logprob <= 0
        assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))  # greedy: the top token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_with_logprobs_scores_the_prompt(client, llm, texts):
    """lm-evaluation-harness's request: token ids, echo, logprobs=1, max_tokens=1."""
    expected = offline(llm, [IDS_PROMPT], max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1)[0]
    response = client.completions.create(
        model=TINY_NAME, prompt=IDS_PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    (choice,) = response.choices
    prompt_text = texts.tokenizer.decode(IDS_PROMPT)
    assert choice.text == prompt_text + expected.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(IDS_PROMPT) + 1
    assert lp.tokens[: len(IDS_PROMPT)] == [texts.text(t) for t in IDS_PROMPT]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [entry[t] for entry, t in zip(expected.prompt_logprobs[1:], IDS_PROMPT[1:], strict=True)]
    assert lp.token_logprobs[1 : len(IDS_PROMPT)] == pytest.approx(want, abs=1e-5)
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, len(lp.tokens)))
    # Echo without logprobs: the prompt text in front, nothing else.
    plain = client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPTS[0]) and plain.choices[0].logprobs is None


def test_streamed_echo_sends_the_prompt_first(client):
    kwargs = dict(model=TINY_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True, logprobs=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPTS[1])
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == whole.logprobs.tokens
    assert [t for c in chunks for t in c.choices[0].logprobs.text_offset] == whole.logprobs.text_offset


def test_chat_logprobs_have_openai_shape(client):
    response = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert isinstance(item.bytes, list)
    chunks = list(
        client.chat.completions.create(
            model=TINY_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_vllm_extra_sampling_fields_are_accepted(client, llm):
    extra = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, ignore_eos=True)
    expected = offline(llm, PROMPTS[0], max_tokens=12, temperature=0.7, seed=5, presence_penalty=0.5, **extra)
    response = client.completions.create(
        model=TINY_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0.7, seed=5, presence_penalty=0.5,
        extra_body=extra,
    )  # fmt: skip
    assert response.choices[0].text == expected[0].outputs[0].text
    assert response.usage.completion_tokens == 12


def test_models_health_and_model_aliases(tiny_server, client, tiny_folder):
    (card,) = client.models.list().data
    assert card.id == TINY_NAME and card.model_extra["max_model_len"] == 1024
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    by_path = client.completions.create(model=str(tiny_folder), prompt="hi", max_tokens=2)
    assert by_path.model == TINY_NAME

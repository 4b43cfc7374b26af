"""vLLM's extra fields that clients send to a vLLM server, served as vLLM serves them, through the official
``openai`` client on the tiny server:

- ``prompt_logprobs: k``: per prompt token (None for the first) its id -> ``{"logprob", "rank",
  "decoded_token"}``, the token itself first (its rank in the whole vocabulary), then the k most likely; in each
  completions choice, at the top of a chat response; a 400 with ``stream`` (0 streams, with nothing to show);
- ``echo`` on chat: the last message's content before the reply when that message has the reply's role;
- ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk's usage so far.
"""

from __future__ import annotations

import openai
import pytest
import torch

from kvserve.attention import ContiguousKVCache
from kvserve.entrypoints.generation import Generator
from kvserve.server.fields import UNSUPPORTED_FIELDS
from kvserve.server.tokens import TokenTexts
from tests.server.conftest import TINY_NAME

IDS_PROMPT = [298, 70, 101, 7, 260, 33, 150, 270]  # BOS + arbitrary ids
MESSAGES = [{"role": "user", "content": "hello there, how are you?"}]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return tiny_server.client()


@pytest.fixture(scope="module")
def texts(tiny_loaded) -> TokenTexts:
    return TokenTexts(tiny_loaded.tokenizer)


@pytest.fixture(scope="module")
def reference(tiny_loaded) -> torch.Tensor:
    """(len - 1, vocab): row i is the log-distribution after IDS_PROMPT[: i + 1], each prefix run on its own."""
    generator, cfg = Generator(tiny_loaded), tiny_loaded.config
    rows = []
    for end in range(1, len(IDS_PROMPT)):
        cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, end, tiny_loaded.dtype)
        rows.append(torch.log_softmax(generator.forward_last(cache, IDS_PROMPT[:end], 0).float(), dim=-1))
    return torch.stack(rows)


def check_prompt_logprobs(positions: list, reference: torch.Tensor, texts: TokenTexts, k: int) -> None:
    assert len(positions) == len(IDS_PROMPT) and positions[0] is None
    for i, position in enumerate(positions[1:]):
        row, token = reference[i], IDS_PROMPT[i + 1]
        keys = list(position)
        assert keys[0] == str(token)  # the prompt token first, then the top k
        mine = position[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert mine["decoded_token"] == texts.text(token)
        # Its rank in the whole vocabulary: 1 + the tokens more likely (within a rounding tolerance).
        low, high = (int((row > row[token] + d).sum()) + 1 for d in (1e-4, -1e-4))
        assert low <= mine["rank"] <= high, (mine, low, high)
        top = sorted(((v["rank"], int(t), v["logprob"]) for t, v in position.items() if v["rank"] <= k))
        assert [rank for rank, _, _ in top] == list(range(1, k + 1))
        best = torch.topk(row, k)
        assert [t for _, t, _ in top] == best.indices.tolist()
        assert [lp for _, _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert set(keys) == {str(token), *(str(t) for _, t, _ in top)}


def test_the_fields_are_served_not_refused():
    assert not {"prompt_logprobs", "echo", "continuous_usage_stats"} & set(UNSUPPORTED_FIELDS)


def test_completion_prompt_logprobs_in_vllms_shape(client, reference, texts):
    response = client.completions.create(
        model=TINY_NAME, prompt=IDS_PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    (choice,) = response.choices
    check_prompt_logprobs(choice.model_extra["prompt_logprobs"], reference, texts, 3)
    assert choice.logprobs is None
    plain = client.completions.create(model=TINY_NAME, prompt=IDS_PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None and plain.choices[0].text == choice.text


def test_prompt_logprobs_zero_gives_each_prompt_token_alone(client, reference, texts):
    response = client.completions.create(
        model=TINY_NAME, prompt=IDS_PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    positions = response.choices[0].model_extra["prompt_logprobs"]
    check_prompt_logprobs(positions, reference, texts, 0)
    assert all(len(position) == 1 for position in positions[1:])


def test_prompt_logprobs_beside_echo_keep_echos_own_count(client, reference, texts):
    """echo + logprobs=1 (lm-evaluation-harness) and prompt_logprobs=4 in one request: each answers its own count."""
    kwargs = dict(model=TINY_NAME, prompt=IDS_PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    alone = client.completions.create(**kwargs).choices[0]
    both = client.completions.create(**kwargs, extra_body={"prompt_logprobs": 4}).choices[0]
    assert both.logprobs == alone.logprobs and both.text == alone.text
    assert all(top is None or len(top) <= 2 for top in both.logprobs.top_logprobs)
    check_prompt_logprobs(both.model_extra["prompt_logprobs"], reference, texts, 4)


def test_chat_prompt_logprobs_are_the_responses(client):
    response = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    positions = response.model_extra["prompt_logprobs"]
    assert len(positions) == response.usage.prompt_tokens and positions[0] is None
    for position in positions[1:]:
        assert 1 <= len(position) <= 2 and all(v["rank"] >= 1 and v["logprob"] <= 0 for v in position.values())
    assert "prompt_logprobs" not in response.choices[0].model_extra


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_are_not_streamed(client, endpoint):
    def create(**kwargs):
        if endpoint == "chat":
            return client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=2, **kwargs)
        return client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2, **kwargs)

    with pytest.raises(openai.BadRequestError) as caught:
        create(stream=True, extra_body={"prompt_logprobs": 1})
    assert caught.value.body["param"] == "prompt_logprobs"
    assert caught.value.body["message"] == "`prompt_logprobs` are not available when `stream=True`."
    chunks = list(create(stream=True, extra_body={"prompt_logprobs": 0}))  # as vLLM: 0 streams
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        create(extra_body={"prompt_logprobs": 21})
    assert caught.value.body["param"] == "prompt_logprobs"


def chat(client: openai.OpenAI, messages: list[dict], **kwargs) -> str:
    reply = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=6, temperature=0, **kwargs)
    return reply.choices[0].message.content


def streamed_chat(client: openai.OpenAI, messages: list[dict], **kwargs) -> list:
    return list(
        client.chat.completions.create(
            model=TINY_NAME, messages=messages, max_tokens=6, temperature=0, stream=True, **kwargs
        )
    )


def test_chat_echo_puts_a_last_assistant_message_before_the_reply(client):
    partial = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    reply = chat(client, partial)
    assert chat(client, partial, extra_body={"echo": True}) == "The answer is" + reply
    chunks = streamed_chat(client, partial, extra_body={"echo": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "The answer is"  # the echo in a chunk of its own, as vLLM
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The answer is" + reply


def test_chat_echo_of_a_message_with_another_role_is_nothing(client):
    """The reply's role is the assistant's: a last user message is not echoed..."""
    assert chat(client, MESSAGES, extra_body={"echo": True}) == chat(client, MESSAGES)
    chunks = streamed_chat(client, MESSAGES, extra_body={"echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat(client, MESSAGES)
    # ...unless there is no generation prompt: the reply then continues the last message, whatever its role.
    bare = {"add_generation_prompt": False}
    assert chat(client, MESSAGES, extra_body={**bare, "echo": True}) == MESSAGES[0]["content"] + chat(
        client, MESSAGES, extra_body=bare
    )


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chat_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = streamed_chat(client, MESSAGES, n=2, stream_options=options)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12  # n=2 x max_tokens=6
    seen = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage.prompt_tokens == final.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens >= seen[choice.index]  # this choice's tokens so far, as vLLM counts them
        seen[choice.index] = usage.completion_tokens
    assert seen == {0: 6, 1: 6}
    assert chunks[0].usage.completion_tokens == 0  # the role chunk
    # Without include_usage, vLLM sends no usage at all.
    plain = streamed_chat(client, MESSAGES, stream_options={"continuous_usage_stats": True})
    assert all(chunk.usage is None for chunk in plain)


def test_continuous_usage_stats_in_a_completions_stream(client):
    stream = client.completions.create(
        model=TINY_NAME, prompt="one two three", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = list(stream)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 5
    counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert all(chunk.usage.prompt_tokens == final.usage.prompt_tokens for chunk in chunks)

"""``POST /v1/chat/completions``: the model's chat template, then one engine request with ``n`` samples."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.prompt_cache.pml import is_pml_prompt
from kvserve.server.errors import bad_request
from kvserve.server.messages import check_messages, template_messages
from kvserve.server.params import chat_params
from kvserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from kvserve.server.serving import DONE, RequestStream, ServeContext, results, sse, sse_error
from kvserve.server.tokens import chat_logprobs
from kvserve.server.truncation import check_keep, refuse_pml, truncate


async def create_chat_completion(ctx: ServeContext, body: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(body.model)
    check_messages(body.messages)
    check_keep(body.truncate_prompt_tokens, ctx.max_model_len)
    prompt = _pml_prompt(body)
    if prompt is None:
        # Rendering the template and tokenising a long chat takes seconds: not on the event loop.
        prompt = await ctx.blocking.run(sum(len(m.text()) for m in body.messages), _encode, ctx, body)
        prompt = truncate(prompt, body.truncate_prompt_tokens)
        ctx.check_prompt(prompt, "messages")
    else:
        refuse_pml(body.truncate_prompt_tokens)
    params = chat_params(body, len(prompt) if isinstance(prompt, list) else 0, ctx.max_model_len, ctx.max_num_seqs)
    request_id = random_id("chatcmpl")
    streams = await ctx.admit(request_id, [prompt], params, prompt_param="messages[0].content")
    if body.stream:
        return StreamingResponse(_stream(ctx, body, request_id, streams[0]), media_type="text/event-stream")
    (out,) = await results(streams, raw)
    choices = [
        ChatChoice(
            index=o.index,
            message=ChatResponseMessage(content=o.text),
            logprobs=_logprobs(ctx, body, o.token_ids, o.logprobs),
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )
        for o in out.outputs
    ]
    response = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=_usage(out))
    return Response(response.model_dump_json(), media_type="application/json")


def _pml_prompt(body: ChatCompletionRequest) -> str | None:
    """A single user message holding a PML prompt is sent as that prompt: its role tags do the chat format."""
    if len(body.messages) == 1 and body.messages[0].role == "user" and is_pml_prompt(body.messages[0].text()):
        return body.messages[0].text()
    return None


def _encode(ctx: ServeContext, body: ChatCompletionRequest) -> list[int]:
    messages = template_messages(body.messages)
    try:
        return ctx.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


def _logprobs(
    ctx: ServeContext, body: ChatCompletionRequest, ids: list[int], entries: list | None
) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return ChatLogprobs(content=chat_logprobs(ctx.texts, ids, entries or [], body.top_logprobs or 0))


def _usage(out: RequestOutput) -> UsageInfo:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in out.outputs)
    return UsageInfo.of(prompt, completion, cached=out.num_cached_tokens)


@dataclass
class _ChoiceState:
    num_chars: int = 0
    num_tokens: int = 0


async def _stream(
    ctx: ServeContext, body: ChatCompletionRequest, request_id: str, stream: RequestStream
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=choices, usage=usage))

    states = [_ChoiceState() for _ in range(body.n)]
    try:
        for index in range(body.n):  # as OpenAI: the role comes first, in a chunk of its own
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        final = None
        async for out in stream:
            for o in out.outputs:
                choice = _delta(ctx, body, o, states[o.index])
                if choice is not None:
                    yield chunk([choice])
            final = out
        if body.include_usage and final is not None:
            yield chunk([], _usage(final))
    except Exception as exc:
        yield sse_error(exc)
    finally:
        stream.abort()
    yield DONE


def _delta(
    ctx: ServeContext, body: ChatCompletionRequest, o: CompletionOutput, state: _ChoiceState
) -> ChatStreamChoice | None:
    text = o.text[state.num_chars :]
    ids, entries = o.token_ids[state.num_tokens :], (o.logprobs or [])[state.num_tokens :]
    state.num_chars, state.num_tokens = len(o.text), len(o.token_ids)
    if not text and o.finish_reason is None and not (body.logprobs and ids):
        return None
    return ChatStreamChoice(
        index=o.index,
        delta=DeltaMessage(content=text) if text else DeltaMessage(),
        logprobs=_logprobs(ctx, body, ids, entries),
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )

"""``POST /v1/chat/completions``: the model's chat template, then one engine request with ``n`` samples.

With ``tools`` the output is read for tool calls (``server/tools.py``): a choice that made calls has
``message.tool_calls`` and ``finish_reason: "tool_calls"``; a stream sends each call's index, id and name
first, then its arguments in fragments, as OpenAI streams them.

vLLM's extras: ``echo`` puts the last message's content before the reply when that message has the reply's
role (``assistant``; any, with ``add_generation_prompt: false``), ``prompt_logprobs`` adds the prompt's in vLLM's
shape to the whole response, and ``stream_options.continuous_usage_stats`` the usage so far to every chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.core.outputs import CompletionOutput, RequestOutput
from kvserve.prompt_cache.pml import is_pml_prompt
from kvserve.server.errors import bad_request
from kvserve.server.messages import check_messages, render_chat
from kvserve.server.params import chat_params
from kvserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    random_id,
)
from kvserve.server.serving import DONE, RequestStream, ServeContext, request_namespace, results, sse, sse_error
from kvserve.server.tokens import chat_logprobs, prompt_logprobs
from kvserve.server.tools import ToolPlan, tool_plan
from kvserve.server.truncation import check_keep, refuse_pml, truncate


async def create_chat_completion(ctx: ServeContext, body: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(body.model)
    check_messages(body.messages)
    check_keep(body.truncate_prompt_tokens, ctx.max_model_len)
    plan = tool_plan(body, ctx.tool_parser)
    prompt = _pml_prompt(body)
    if prompt is None:
        # Rendering the template and tokenising a long chat takes seconds: not on the event loop.
        prompt = await ctx.blocking.run(sum(len(m.text()) for m in body.messages), _encode, ctx, body, plan)
        prompt = truncate(prompt, body.truncate_prompt_tokens)
        ctx.check_prompt(prompt, "messages")
    else:
        refuse_pml(body.truncate_prompt_tokens)
        if plan is not None:
            raise bad_request(
                "tools cannot be offered with a Prompt Cache prompt: its schema fixes the prompt", "tools"
            )
    prompt_len = len(prompt) if isinstance(prompt, list) else 0
    guided = plan.guided if plan is not None else None
    params = chat_params(body, prompt_len, ctx.max_model_len, ctx.max_num_seqs, guided)
    request_id = random_id("chatcmpl")
    streams = await ctx.admit(
        request_id, [prompt], params, "messages[0].content", body.cache_salt, request_namespace(raw)
    )
    if body.stream:
        events = _stream(ctx, body, plan, request_id, streams[0], prompt_len)
        return StreamingResponse(events, media_type="text/event-stream")
    (out,) = await results(streams, raw)
    echo = _echo(body)
    choices = [
        ChatChoice(
            index=o.index,
            message=message,
            logprobs=_logprobs(ctx, body, o.token_ids, o.logprobs),
            finish_reason=_finish_reason(o, bool(message.tool_calls)),
            stop_reason=o.stop_reason,
        )
        for o in out.outputs
        for message in [_message(plan, o, echo)]
    ]
    response = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=_usage(out))
    if body.prompt_logprobs is not None:
        response.prompt_logprobs = prompt_logprobs(ctx.texts, out, body.prompt_logprobs)
    return Response(response.model_dump_json(), media_type="application/json")


def _pml_prompt(body: ChatCompletionRequest) -> str | None:
    """A single user message holding a PML prompt is sent as that prompt: its role tags do the chat format."""
    if len(body.messages) == 1 and body.messages[0].role == "user" and is_pml_prompt(body.messages[0].text()):
        return body.messages[0].text()
    return None


def _encode(ctx: ServeContext, body: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
    tools = plan.tools if plan else None
    text = render_chat(ctx.tokenizer, body.messages, body.add_generation_prompt, tools, ctx.tool_parser)
    return ctx.tokenizer.encode(text, add_special_tokens=False)  # the template writes its own BOS


def _echo(body: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the reply (vLLM's rule): the last message's content, if it has the reply's role."""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    return last.text() if body.echo and last.role == role else ""


def _message(plan: ToolPlan | None, o: CompletionOutput, echo: str = "") -> ChatResponseMessage:
    if plan is None:
        return ChatResponseMessage(content=echo + o.text)
    parsed = plan.read(o.text, final=True)
    calls = [
        ToolCall(id=plan.call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls
    ]
    content = parsed.content.strip() or None
    return ChatResponseMessage(content=echo + (content or "") if echo else content, tool_calls=calls or None)


def _finish_reason(o: CompletionOutput, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and o.finish_reason == "stop" else o.finish_reason


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
    content_chars: int = 0  # with tools: the content sent, and each call's argument characters sent
    sent_arguments: list[int] = field(default_factory=list)


async def _stream(
    ctx: ServeContext,
    body: ChatCompletionRequest,
    plan: ToolPlan | None,
    request_id: str,
    stream: RequestStream,
    prompt_len: int,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=choices, usage=usage))

    def so_far(completion: int, out: RequestOutput | None = None) -> UsageInfo | None:
        """``continuous_usage_stats``: a chunk's usage so far (before the engine's first output, the prompt's)."""
        if not body.continuous_usage:
            return None
        if out is None:
            return UsageInfo.of(prompt_len, completion, cached=0)
        return UsageInfo.of(len(out.prompt_token_ids), completion, cached=out.num_cached_tokens)

    states = [_ChoiceState() for _ in range(body.n)]
    try:
        for index in range(body.n):  # as OpenAI: the role comes first, in a chunk of its own
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))], so_far(0))
        echo = _echo(body)
        for index in range(body.n if echo else 0):  # as vLLM: the echo in a chunk of its own
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=echo))], so_far(0))
        final = None
        async for out in stream:
            for o in out.outputs:
                choice = _delta(ctx, body, plan, o, states[o.index])
                if choice is not None:
                    yield chunk([choice], so_far(len(o.token_ids), out))
            final = out
        if body.include_usage and final is not None:
            yield chunk([], _usage(final))
    except Exception as exc:
        yield sse_error(exc)
    finally:
        stream.abort()
    yield DONE


def _delta(
    ctx: ServeContext, body: ChatCompletionRequest, plan: ToolPlan | None, o: CompletionOutput, state: _ChoiceState
) -> ChatStreamChoice | None:
    text = o.text[state.num_chars :]
    ids, entries = o.token_ids[state.num_tokens :], (o.logprobs or [])[state.num_tokens :]
    state.num_chars, state.num_tokens = len(o.text), len(o.token_ids)
    delta = DeltaMessage(content=text) if text else DeltaMessage()
    if plan is not None:
        delta = _tool_delta(plan, o, state)
    if delta.content is None and delta.tool_calls is None and o.finish_reason is None and not (body.logprobs and ids):
        return None
    return ChatStreamChoice(
        index=o.index,
        delta=delta,
        logprobs=_logprobs(ctx, body, ids, entries),
        finish_reason=_finish_reason(o, bool(state.sent_arguments)),
        stop_reason=o.stop_reason,
    )


def _tool_delta(plan: ToolPlan, o: CompletionOutput, state: _ChoiceState) -> DeltaMessage:
    """What of the content and the calls read from the output so far has not been sent yet."""
    parsed = plan.read(o.text, final=o.finish_reason is not None)
    content = parsed.content[state.content_chars :]
    state.content_chars = max(state.content_chars, len(parsed.content))
    calls: list[DeltaToolCall] = []
    for index, call in enumerate(parsed.calls):
        if index == len(state.sent_arguments):
            if call.name is None:  # a call is announced once its name is known
                break
            state.sent_arguments.append(0)
            first = DeltaFunctionCall(name=call.name, arguments="")
            calls.append(DeltaToolCall(index=index, id=plan.call_id(), type="function", function=first))
        fragment = call.arguments[state.sent_arguments[index] :]
        if fragment:
            calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
            state.sent_arguments[index] = len(call.arguments)
    return DeltaMessage(content=content or None, tool_calls=calls or None)

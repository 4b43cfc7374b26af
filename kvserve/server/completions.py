"""``POST /v1/completions``: one engine request per prompt; choice ``i * n + j`` is prompt i's sample j.

``echo`` puts the prompt in front of each choice's text; with ``logprobs`` it also puts the prompt
tokens' logprobs in front (the first is None), which is how lm-evaluation-harness scores a model.
vLLM's ``prompt_logprobs`` gives them in vLLM's shape instead, in each choice of the whole response;
``stream_options.continuous_usage_stats`` puts the usage so far in every streamed chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.core.outputs import CompletionOutput, RequestOutput
from kvserve.prompt_cache.pml import is_pml_prompt
from kvserve.server.errors import bad_request
from kvserve.server.params import completion_params
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
    random_id,
)
from kvserve.server.serving import (
    DONE,
    RequestStream,
    ServeContext,
    merged,
    request_namespace,
    results,
    sse,
    sse_error,
)  # fmt: skip
from kvserve.server.tokens import completion_logprobs, prompt_logprobs
from kvserve.server.truncation import check_keep, refuse_pml, truncate


@dataclass
class _Prompt:
    ids: list[int] | str  # token ids, or a PML prompt the engine prepares (Prompt Cache)
    text: str  # what echo writes back


async def create_completion(ctx: ServeContext, body: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(body.model)
    params = completion_params(body, ctx.max_num_seqs)
    check_keep(body.truncate_prompt_tokens, ctx.max_model_len)
    # Tokenising (and detokenising ids for echo) a large prompt takes seconds: not on the event loop.
    prompts = await ctx.blocking.run(_prompt_size(body.prompt), _prompts, ctx, body, params.skip_special_tokens)
    request_id = random_id("cmpl")
    streams = await ctx.admit(
        request_id, [p.ids for p in prompts], params, cache_salt=body.cache_salt, namespace=request_namespace(raw)
    )
    if body.stream:
        return StreamingResponse(_stream(ctx, body, request_id, prompts, streams), media_type="text/event-stream")
    outputs = await results(streams, raw)
    choices = [_choice(ctx, body, prompts[i], out, o, i * body.n) for i, out in enumerate(outputs) for o in out.outputs]
    response = CompletionResponse(
        id=request_id, model=ctx.model_name, choices=sorted(choices, key=lambda c: c.index), usage=_usage(outputs)
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _prompt_size(prompt: object) -> int:
    """Characters or token ids in the prompt(s): what tokenising them costs."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return len(prompt)
    return sum(len(item) for item in prompt)


def _prompts(ctx: ServeContext, body: CompletionRequest, skip_special: bool) -> list[_Prompt]:
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be an empty list", "prompt")
    tokenizer = ctx.tokenizer
    out = []
    for item in items:
        if is_pml_prompt(item):
            refuse_pml(body.truncate_prompt_tokens)
            out.append(_Prompt(item, item))
            continue
        whole = tokenizer.encode(item, body.add_special_tokens) if isinstance(item, str) else list(item)
        ids = truncate(whole, body.truncate_prompt_tokens)
        ctx.check_prompt(ids, "prompt")  # first: ids outside the vocabulary cannot be decoded
        text = item if ids is whole and isinstance(item, str) else tokenizer.decode(ids, skip_special)
        out.append(_Prompt(ids, text))
    return out


def _choice(
    ctx: ServeContext, body: CompletionRequest, prompt: _Prompt, out: RequestOutput, o: CompletionOutput, base: int
) -> CompletionResponseChoice:
    text = prompt.text + o.text if body.echo else o.text
    logprobs = None
    if body.logprobs is not None:
        ids, entries = _with_prompt(body, out, o.token_ids, o.logprobs or [])
        logprobs = completion_logprobs(ctx.texts, ids, entries)
    asked = body.prompt_logprobs
    return CompletionResponseChoice(
        index=base + o.index, text=text, logprobs=logprobs, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
        prompt_logprobs=None if asked is None else prompt_logprobs(ctx.texts, out, asked),
    )  # fmt: skip


def _with_prompt(body: CompletionRequest, out: RequestOutput, ids: Sequence[int], entries: Sequence) -> tuple:
    if not body.echo:
        return list(ids), list(entries)
    prompt_entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    if (body.prompt_logprobs or 0) > body.logprobs:  # computed for prompt_logprobs: echo shows logprobs' count
        prompt_entries = [_top(e, body.logprobs, t) for e, t in zip(prompt_entries, out.prompt_token_ids, strict=True)]
    return [*out.prompt_token_ids, *ids], [*prompt_entries, *entries]


def _top(entry: dict[int, float] | None, k: int, token_id: int) -> dict[int, float] | None:
    """The ``k`` most likely tokens of a position's logprobs, and its own token."""
    if entry is None:
        return None
    kept = dict(sorted(entry.items(), key=lambda item: -item[1])[:k])
    kept[token_id] = entry[token_id]
    return kept


def _usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    return UsageInfo.of(prompt, completion, cached=sum(out.num_cached_tokens for out in outputs))


def _usage_so_far(out: RequestOutput, o: CompletionOutput) -> UsageInfo:
    """``continuous_usage_stats``: a chunk's prompt and this choice's tokens so far, as vLLM counts them."""
    return UsageInfo.of(len(out.prompt_token_ids), len(o.token_ids), cached=out.num_cached_tokens)


@dataclass
class _ChoiceState:
    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False


async def _stream(
    ctx: ServeContext,
    body: CompletionRequest,
    request_id: str,
    prompts: list[_Prompt],
    streams: list[RequestStream],
) -> AsyncIterator[str]:
    states: dict[int, _ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merged(streams):
            for o in out.outputs:
                if not o.token_ids and o.finish_reason is None:
                    continue  # still computing the prompt
                state = states.setdefault(i * body.n + o.index, _ChoiceState())
                choice = _delta(ctx, body, prompts[i], out, o, i * body.n, state)
                if choice is not None:
                    usage = _usage_so_far(out, o) if body.continuous_usage else None
                    yield sse(CompletionChunk(id=request_id, model=ctx.model_name, choices=[choice], usage=usage))
            if out.finished:
                finals[i] = out
        if body.include_usage:
            usage = _usage([finals[i] for i in sorted(finals)])
            yield sse(CompletionChunk(id=request_id, model=ctx.model_name, choices=[], usage=usage))
    except Exception as exc:
        yield sse_error(exc)
    finally:
        for stream in streams:
            stream.abort()
    yield DONE


def _delta(
    ctx: ServeContext,
    body: CompletionRequest,
    prompt: _Prompt,
    out: RequestOutput,
    o: CompletionOutput,
    base: int,
    state: _ChoiceState,
) -> CompletionChoice | None:
    """The part of choice ``o`` not sent yet, or None when there is nothing new to send."""
    text = o.text[state.num_chars :]
    ids, entries = o.token_ids[state.num_tokens :], (o.logprobs or [])[state.num_tokens :]
    state.num_chars, state.num_tokens = len(o.text), len(o.token_ids)
    if body.echo and not state.started:
        text = prompt.text + text
        ids, entries = _with_prompt(body, out, ids, entries)
    state.started = True
    if not text and o.finish_reason is None and (body.logprobs is None or not ids):
        return None
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(ctx.texts, ids, entries, state.text_offset) if ids else CompletionLogprobs()
        state.text_offset += sum(ctx.texts.num_chars(t) for t in ids)
    return CompletionChoice(
        index=base + o.index, text=text, logprobs=logprobs, finish_reason=o.finish_reason, stop_reason=o.stop_reason
    )

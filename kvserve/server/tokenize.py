"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes, with the served model's own tokenizer.

``/tokenize`` takes a ``prompt`` (BOS added unless ``add_special_tokens`` is false) or chat ``messages``
(rendered by the chat template, which writes its own BOS; ``add_generation_prompt`` and ``tools`` as for chat) and
returns ``{"tokens", "count", "max_model_len"}`` (``token_strs`` too with ``return_token_strs``).
``/detokenize`` turns ``tokens`` back into ``{"prompt"}``, special tokens included. Large inputs are
worked on off the event loop, like the generation endpoints' prompts.
"""

from __future__ import annotations

from starlette.responses import Response

from kvserve.server.errors import bad_request
from kvserve.server.messages import check_messages, render_chat
from kvserve.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from kvserve.server.serving import ServeContext


async def tokenize(ctx: ServeContext, body: TokenizeRequest) -> Response:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send either 'prompt' (text) or 'messages' (a chat), not both or neither", "prompt")
    if body.messages is not None:
        check_messages(body.messages)
        cost = sum(len(m.text()) for m in body.messages)
    else:
        cost = len(body.prompt)
    ids, strs = await ctx.blocking.run(cost, _tokenize, ctx, body)
    response = TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)
    return Response(response.model_dump_json(), media_type="application/json")


def _tokenize(ctx: ServeContext, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    tokenizer = ctx.tokenizer
    if body.messages is None:
        add_special = body.add_special_tokens if body.add_special_tokens is not None else True
        ids = tokenizer.encode(body.prompt, add_special_tokens=add_special)
    else:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        text = render_chat(tokenizer, body.messages, body.add_generation_prompt, tools, ctx.tool_parser)
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None


async def detokenize(ctx: ServeContext, body: DetokenizeRequest) -> Response:
    ctx.check_model(body.model)
    prompt = await ctx.blocking.run(len(body.tokens), _detokenize, ctx, body.tokens)
    return Response(DetokenizeResponse(prompt=prompt).model_dump_json(), media_type="application/json")


def _detokenize(ctx: ServeContext, ids: list[int]) -> str:
    vocab = ctx.tokenizer.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise bad_request(
            f"tokens {bad[:5]} are outside the tokenizer's vocabulary of {vocab} tokens (ids 0 to {vocab - 1})",
            "tokens",
        )
    return ctx.tokenizer.decode(ids, skip_special_tokens=False)

"""Prompt Cache schemas over HTTP: ``POST /v1/schemas`` ({"pml": "<schema ...>"}), ``GET /v1/schemas``,
``GET /v1/schemas/{name}``, ``DELETE /v1/schemas/{name}``.

Registering queues the schema's modules to be encoded (eagerly unless the engine encodes lazily): the
scheduler runs each encoding as a prefill in chunks, between the steps of requests in flight, and the
response comes once they are done. Requests in flight keep their modules until they finish even if their
schema is deleted. A schema is a list entry with its module layout (positions, tokens, parameters).

Names resolve in the caller's namespace (one per API key on a server with several, ``kvserve/core/isolation.py``):
another key's schema is a 404 exactly like a missing one, so its existence does not leak.
"""

from __future__ import annotations

import asyncio
import json

from starlette.responses import Response

from kvserve.core.engine import LLMEngine
from kvserve.prompt_cache.pml import PMLError
from kvserve.prompt_cache.store import PromptCacheError
from kvserve.server.errors import ApiError, bad_request
from kvserve.server.protocol import SchemaRequest
from kvserve.server.serving import ServeContext

ENCODING_POLL_S = 0.02  # how often a registration checks whether its modules are encoded


async def create_schema(ctx: ServeContext, body: SchemaRequest, namespace: str) -> Response:
    try:
        name = (await ctx.engine.call(lambda engine: engine.register_schema(body.pml, namespace)))["name"]
    except (PMLError, PromptCacheError, ValueError) as exc:
        raise bad_request(str(exc), "pml") from None
    # The engine thread encodes the modules in its steps, between other requests' work; answer once they are.
    while await ctx.engine.call(lambda engine: engine.prompt_cache.encoding(name, namespace)):
        await asyncio.sleep(ENCODING_POLL_S)
    try:
        info = await ctx.engine.call(lambda engine: engine.prompt_cache.info(name, namespace).to_dict())
    except KeyError as exc:  # deleted meanwhile
        raise _not_found(exc) from None
    return _json({"object": "schema", **info})


async def list_schemas(ctx: ServeContext, namespace: str) -> Response:
    def collect(engine: LLMEngine) -> list[dict]:
        cache = engine.prompt_cache
        return [{"object": "schema", **cache.info(name, namespace).to_dict()} for name in cache.names(namespace)]

    return _json({"object": "list", "data": await ctx.engine.call(collect)})


async def get_schema(ctx: ServeContext, name: str, namespace: str) -> Response:
    try:
        info = await ctx.engine.call(lambda engine: engine.prompt_cache.info(name, namespace).to_dict())
    except KeyError as exc:
        raise _not_found(exc) from None
    return _json({"object": "schema", **info})


async def delete_schema(ctx: ServeContext, name: str, namespace: str) -> Response:
    try:
        await ctx.engine.call(lambda engine: engine.prompt_cache.remove(name, namespace))
    except KeyError as exc:
        raise _not_found(exc) from None
    return _json({"id": name, "object": "schema", "deleted": True})


def _not_found(exc: KeyError) -> ApiError:
    return ApiError(404, exc.args[0], "name", code="schema_not_found")


def _json(payload: dict) -> Response:
    return Response(json.dumps(payload), media_type="application/json")

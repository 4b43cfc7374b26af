"""The OpenAI-compatible HTTP API: ``build_app(async_engine, model_name, api_key=None)`` -> FastAPI app.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as server-sent events
with ``stream: true``; a prompt starting with ``<prompt schema=...>`` is a Prompt Cache prompt),
``POST/GET /v1/schemas``, ``GET/DELETE /v1/schemas/{name}`` (Prompt Cache schemas, see
``server/schemas.py``), ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize`` (``server/tokenize.py``),
``GET /version``, ``GET /health``, ``GET /metrics``. With an ``api_key`` (or several), every ``/v1`` route and
the two tokenizer routes (they spend CPU on the caller's input) need ``Authorization: Bearer <key>``;
``/version``, ``/health`` and ``/metrics`` stay open. With several keys each key is a tenant: its schemas and
its prefix-cache blocks are its own (``kvserve/core/isolation.py``).
A body over ``max_request_bytes`` gets 413; large bodies and prompts are parsed and tokenised off the
event loop (``server/blocking.py``).
Errors use OpenAI's shape with the offending field in ``param``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import kvserve
from kvserve.core.isolation import key_namespaces
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.blocking import BlockingWork
from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.errors import ApiError, from_validation_errors
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SchemaRequest,
    TokenizeRequest,
)
from kvserve.server.schemas import create_schema, delete_schema, get_schema, list_schemas
from kvserve.server.serving import NAMESPACE_STATE, ClientDisconnected, ServeContext, request_namespace
from kvserve.server.tokenize import detokenize, tokenize
from kvserve.server.tokens import TokenTexts
from kvserve.server.tool_parsers import check_parser, detect_parser

CLIENT_CLOSED = 499  # nginx's status for a client that hung up; nobody receives it
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")  # what needs the API key when the server has one


def build_app(
    async_engine: AsyncEngine,
    model_name: str,
    api_key: str | Sequence[str] | None = None,
    model_aliases: Iterable[str] = (),
    model_root: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app; its lifespan starts the engine thread and shuts it down (aborting what is left).
    ``tool_call_parser``: the syntax of the model's tool calls; default: the one its chat template teaches."""
    if max_request_bytes < 1:  # checked here: Starlette builds its middleware only at the first request
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    tokenizer = async_engine.engine.tokenizer
    check_parser(tool_call_parser, tokenizer.chat_template)
    ctx = ServeContext(
        engine=async_engine,
        model_name=model_name,
        accepted_names=frozenset([model_name, *model_aliases]),
        texts=TokenTexts(tokenizer),
        blocking=BlockingWork(),
        tool_parser=tool_call_parser or detect_parser(tokenizer.chat_template),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown)
        ctx.blocking.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.ctx = ctx
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    _add_error_handlers(app)

    _add_generation_routes(app, ctx)
    _add_schema_routes(app, ctx)
    _add_service_routes(app, ctx, model_name, model_root)
    return app


def _add_generation_routes(app: FastAPI, ctx: ServeContext) -> None:
    """The OpenAI endpoints and the tokenizer's."""

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, await _parse(ctx, raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, await _parse(ctx, raw, ChatCompletionRequest), raw)

    @app.post("/tokenize")
    async def tokenize_route(raw: Request) -> Response:
        return await tokenize(ctx, await _parse(ctx, raw, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(raw: Request) -> Response:
        return await detokenize(ctx, await _parse(ctx, raw, DetokenizeRequest))


def _add_schema_routes(app: FastAPI, ctx: ServeContext) -> None:
    """Prompt Cache schemas."""

    @app.post("/v1/schemas")
    async def schemas_create(raw: Request) -> Response:
        return await create_schema(ctx, await _parse(ctx, raw, SchemaRequest), request_namespace(raw))

    @app.get("/v1/schemas")
    async def schemas_list(raw: Request) -> Response:
        return await list_schemas(ctx, request_namespace(raw))

    @app.get("/v1/schemas/{name}")
    async def schemas_get(name: str, raw: Request) -> Response:
        return await get_schema(ctx, name, request_namespace(raw))

    @app.delete("/v1/schemas/{name}")
    async def schemas_delete(name: str, raw: Request) -> Response:
        return await delete_schema(ctx, name, request_namespace(raw))


def _add_service_routes(app: FastAPI, ctx: ServeContext, model_name: str, model_root: str | None) -> None:
    """The model list, version, health and metrics."""
    async_engine = ctx.engine

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=model_name, root=model_root, max_model_len=ctx.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/health")
    async def health() -> Response:
        reason = async_engine.health_error()
        if reason is not None:
            return _error(ApiError(503, reason, type="server_error"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = async_engine.metrics.render() if async_engine.metrics is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _parse(ctx: ServeContext, raw: Request, model: type[BaseModel]) -> BaseModel:
    """The JSON body as ``model``, whatever the content type says (``curl -d`` sends a form type)."""
    body = await raw.body()
    try:
        return await ctx.blocking.run(len(body), model.model_validate_json, body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body().model_dump(), status_code=exc.status, headers=exc.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(from_validation_errors(exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _error(ApiError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return _error(ApiError(500, f"internal server error: {exc!r}", type="server_error"))


class ApiKeyMiddleware:
    """Plain ASGI (so streaming responses pass through untouched): ``KEYED_PATHS`` need a bearer key, and the
    request carries that key's namespace (``kvserve/core/isolation.py``) in ``scope["state"]``."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        namespaces = key_namespaces(list(api_keys))
        self.expected = [(f"Bearer {key}".encode(), ns) for key, ns in zip(api_keys, namespaces, strict=True)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(KEYED_PATHS) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization")
            namespace = None
            for expected, key_namespace in self.expected:  # every key compared: the time names no key
                if given is not None and secrets.compare_digest(given, expected):
                    namespace = key_namespace
            if namespace is None:
                message = "missing API key: send 'Authorization: Bearer <key>'" if given is None else "invalid API key"
                error = ApiError(401, message, None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await _error(error)(scope, receive, send)
                return
            scope.setdefault("state", {})[NAMESPACE_STATE] = namespace
        await self.app(scope, receive, send)

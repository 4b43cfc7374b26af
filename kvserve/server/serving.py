"""What both endpoints share: admission into the engine, results with disconnect detection, SSE framing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request

from kvserve.core.isolation import GLOBAL_NAMESPACE, check_cache_salt
from kvserve.core.outputs import RequestOutput
from kvserve.prompt_cache.pml import PMLError
from kvserve.prompt_cache.store import ModuleRoomError, PromptCacheError
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.server.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineStoppedError,
    QueueFullError,
    QueueTooSmallError,
    RequestStream,
)
from kvserve.server.blocking import BlockingWork
from kvserve.server.errors import ApiError, bad_request
from kvserve.server.tokens import TokenTexts

RETRY_AFTER_S = 1
NAMESPACE_STATE = "kvserve_namespace"  # where ``ApiKeyMiddleware`` leaves the caller's namespace in the scope
DONE = "data: [DONE]\n\n"


@dataclass
class ServeContext:
    """Everything a handler needs; built once by ``build_app``."""

    engine: AsyncEngine
    model_name: str
    accepted_names: frozenset[str]
    texts: TokenTexts
    blocking: BlockingWork
    tool_parser: str = "hermes"  # the syntax of the model's tool calls (``server/tool_parsers.py``)

    @property
    def tokenizer(self):  # noqa: ANN201 - kvserve.text.tokenizer.Tokenizer
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.engine.config.max_num_seqs

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise ApiError(
                404, f"The model `{name}` does not exist; this server serves `{self.model_name}`", "model",
                code="model_not_found",
            )  # fmt: skip

    def check_prompt(self, ids: Sequence[int], param: str) -> None:
        try:
            self.engine.engine.validate_prompt(ids if isinstance(ids, list) else list(ids))
        except ValueError as exc:
            raise bad_request(str(exc), param) from None

    async def admit(
        self,
        request_id: str,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams,
        prompt_param: str = "prompt",
        cache_salt: str | None = None,
        namespace: str = GLOBAL_NAMESPACE,
    ) -> list[RequestStream]:
        """One engine request per prompt (token ids, or PML prompt text), all admitted or none; errors become
        400 / 503. A PML prompt's errors name ``prompt_param``, the field that held it. ``cache_salt`` and
        ``namespace`` (the caller's API key's) isolate the request's cache use (``kvserve/core/isolation.py``)."""
        try:
            check_cache_salt(cache_salt, any(isinstance(p, str) for p in prompts))  # a str prompt: a PML one
        except ValueError as exc:
            raise bad_request(str(exc), "cache_salt") from None
        try:
            self.engine.engine.validate_params(params)
        except ValueError as exc:  # the message starts with the field's name
            raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from None
        try:
            self.engine.engine.policy_for(params)
        except ValueError as exc:
            raise bad_request(str(exc), _policy_param(params)) from None
        items = [(f"{request_id}-{i}", ids, params) for i, ids in enumerate(prompts)]
        try:
            return await self.engine.add_requests(items, cache_salt, namespace)
        except QueueTooSmallError as exc:
            raise bad_request(str(exc), "prompt") from None
        except QueueFullError as exc:
            raise ApiError(503, str(exc), None, "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStoppedError as exc:
            raise ApiError(503, str(exc), None, "server_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ModuleRoomError as exc:  # running requests hold the blocks a module needs: retry later
            raise ApiError(503, str(exc), None, "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (PMLError, PromptCacheError) as exc:
            raise bad_request(str(exc), prompt_param) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None


def request_namespace(raw: Request) -> str:
    """The caller's namespace, as ``ApiKeyMiddleware`` found it from the API key (``kvserve/core/isolation.py``)."""
    return raw.scope.get("state", {}).get(NAMESPACE_STATE, GLOBAL_NAMESPACE)


def _policy_param(params: SamplingParams) -> str:
    """The field to blame when the engine cannot run a request's KV policy."""
    if params.kv_policy is not None:
        return "kv_policy"
    return "kv_budget" if params.kv_budget is not None else "n"


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def results(streams: Sequence[RequestStream], raw: Request) -> list[RequestOutput]:
    """The final output of every stream; aborts them all if the client disconnects or anything fails."""
    gather = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not gather.done():
            raise ClientDisconnected()
        return gather.result()
    except EngineStepError as exc:
        raise ApiError(500, str(exc), None, "server_error") from None
    except EngineStoppedError as exc:
        raise ApiError(503, str(exc), None, "server_error") from None
    finally:
        watch.cancel()
        if not gather.done():
            gather.cancel()
            # A cancelled gather ends holding a CancelledError that asyncio logs, with a traceback, unless read.
            gather.add_done_callback(_read_exception)
        for stream in streams:
            stream.abort()


def _read_exception(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; the caller aborts the streams."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


# Characters JSON leaves raw that ``str.splitlines`` (and so httpx's ``aiter_lines``) takes for line ends: escaped,
# a client that splits an event stream that way still gets each event whole. The decoded text is the same.
_LINE_SEPARATORS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json().translate(_LINE_SEPARATORS)}\n\n"


def sse_error(exc: Exception) -> str:
    error = exc if isinstance(exc, ApiError) else ApiError(500, str(exc), None, "server_error")
    return f"data: {error.body().model_dump_json().translate(_LINE_SEPARATORS)}\n\n"

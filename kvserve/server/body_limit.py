"""``BodyLimitMiddleware``: a request body over ``--max-request-bytes`` gets 413 before it is read in full.

A declared ``Content-Length`` over the limit is answered at once, without reading the body; a chunked
upload is counted as it arrives and answered as soon as it passes the limit.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import ApiError

# The default model's whole 8k-token context is ~40 KB of text, or ~60 KB as a JSON list of token ids;
# a 128k-token model's is ~1 MB as ids. 4 MiB holds that with room for a batch of prompts or a long chat,
# and bounds what one request can make the server parse and tokenise (about a second of tokenising).
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class RequestTooLarge(ApiError):
    """An ``ApiError`` so that a handler reading the body turns it into the 413 like any other error."""

    def __init__(self, size: str, limit: int) -> None:
        message = f"the request body is {size}; the limit is {limit:,} bytes (--max-request-bytes)"
        super().__init__(413, message, None, code="request_too_large")


class BodyLimitMiddleware:
    """Plain ASGI (so streaming responses pass through untouched)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = RequestTooLarge(f"{declared:,} bytes", self.max_bytes)
            await JSONResponse(error.body().model_dump(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(f"over the limit ({received:,} bytes received so far)", self.max_bytes)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server rejects a malformed length itself
    return None

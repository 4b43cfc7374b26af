"""Event-stream lines as the SSE format splits them, against text a model may generate: the benchmark clients'
reader (``bench/sse.py``) and the server's escaping (``server/serving.py``)."""

from __future__ import annotations

import asyncio
import json

import httpx
from pydantic import BaseModel

from kvserve.bench.sse import sse_lines
from kvserve.server.serving import sse

TEXT = "one\u2028two\x85three\u2029four"  # each a line end to str.splitlines, none to an event stream


class Chunk(BaseModel):
    text: str


def read(chunks: list[bytes]) -> list[str]:
    """The lines ``sse_lines`` gives for a body streamed in ``chunks``."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Stream(chunks))

    async def collect() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            async with client.stream("GET", "http://test/") as response:
                return [line async for line in sse_lines(response)]

    return asyncio.run(collect())


class Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk


def test_a_data_line_holding_unicode_line_separators_stays_whole() -> None:
    raw = f"data: {json.dumps({'text': TEXT}, ensure_ascii=False)}\n\ndata: [DONE]\n\n".encode()
    cut = raw.index(b"\xe2\x80\xa8") + 1  # a chunk ends inside U+2028's UTF-8 bytes
    for chunks in ([raw], [raw[:cut], raw[cut:]], [bytes([b]) for b in raw]):
        lines = [line for line in read(chunks) if line]
        assert lines == [lines[0], "data: [DONE]"] and json.loads(lines[0][6:])["text"] == TEXT


def test_every_line_end_of_the_format_ends_a_line() -> None:
    assert read([b"data: a\r\ndata: b\rdata: c\n\ndata: d"]) == ["data: a", "data: b", "data: c", "", "data: d"]
    assert [line for line in read([b"data: a\r", b"\ndata: b\n"]) if line] == ["data: a", "data: b"]


def test_the_server_escapes_what_splitlines_would_split_at() -> None:
    event = sse(Chunk(text=TEXT))
    assert event.endswith("\n\n") and event[:-2].splitlines() == [event[:-2]]  # one line, even to splitlines
    assert json.loads(event[len("data: ") :])["text"] == TEXT  # the same text once decoded

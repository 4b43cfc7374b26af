"""The lines of a text/event-stream response, split where the SSE format says a line ends.

An event stream's lines end at CR LF, LF or CR only. httpx's ``aiter_lines`` splits like ``str.splitlines``,
also at U+2028, U+2029, U+0085 and other separators, which a JSON string in a ``data:`` field may hold raw (a
model can generate them): the event then arrives cut in two. kvserve's server escapes those characters
(``server/serving.py``), but a benchmark also reads other servers' streams.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx

_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Each line of ``response``'s body, without its line end (an empty line ends an event; a CR LF cut between
    two chunks gives one more empty line, which a reader of ``data:`` lines skips like any)."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _LINE_END.split(pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending

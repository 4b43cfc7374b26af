"""``BlockingWork``: CPU-heavy request work (parsing a large body, tokenising, rendering a chat template,
detokenising an echoed prompt) run off the event loop, so one large request never stalls ``/health``
or the other streams.

Small inputs run inline: handing them to a thread costs more than the work, and they never queue behind
a large one. Large inputs go to a few worker threads (the Rust tokenizer releases the GIL while it
encodes, so the event loop keeps running); more large requests than workers wait their turn there
instead of taking every core from the engine thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

INLINE_COST = 4096  # characters (or token ids, or body bytes): about a millisecond of tokenising
NUM_WORKERS = 2  # large requests tokenised at once; the engine thread needs a core of its own


class BlockingWork:
    def __init__(self, inline_cost: int = INLINE_COST, num_workers: int = NUM_WORKERS) -> None:
        self.inline_cost = inline_cost
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kvserve-tokenize")

    async def run(self, cost: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``: inline when ``cost`` (the size of its input) is small, else in a worker thread."""
        if cost <= self.inline_cost:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

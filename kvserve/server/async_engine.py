"""``AsyncEngine``: an ``LLMEngine`` stepping in its own thread, fed and read from asyncio.

The engine is not thread-safe, so exactly one thread touches it: the engine thread. The asyncio side
(the HTTP handlers) talks to it through a thread-safe inbox of commands (add, abort, call) guarded by a
``threading.Condition``; the engine thread drains the inbox between steps and sleeps on the condition
while it has no work, so HTTP handling never waits for a step and a step never waits for HTTP.
Results travel back per request: the engine thread hands each ``RequestOutput`` (or an exception) to
the request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. Outputs carry cumulative text and
tokens, so a reader that falls behind takes only the newest one and loses nothing.

An exception inside ``step()`` fails the requests in flight (their readers get an ``EngineStepError``)
and aborts them in the engine; the thread keeps serving new requests. A KV tier fault is the engine's own
to handle: it fails only the requests it touched (an output with ``error``, handed on as an ``EngineStepError``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.core.engine import LLMEngine
from kvserve.core.isolation import GLOBAL_NAMESPACE
from kvserve.core.outputs import RequestOutput
from kvserve.log import get_logger
from kvserve.platform import faults
from kvserve.platform.heap import HeapTrimmer
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.server.metrics import EngineSnapshot, ServerMetrics


def offload_counters(engine: LLMEngine) -> dict[str, int]:
    """Bytes an offloading engine has moved between its tiers (none for the others)."""
    moved = engine.runner.cache.bytes_moved()
    return {f"kv_offload_bytes_{name}": count for name, count in moved.items()}


class QueueFullError(Exception):
    """The server holds ``max_queue`` requests already (waiting + running); retry later."""


class QueueTooSmallError(ValueError):
    """More requests at once than ``max_queue`` ever holds: retrying cannot help."""


class EngineStoppedError(Exception):
    """The engine is shutting down and takes no more requests."""


class EngineStepError(Exception):
    """An engine step failed; the requests it was running were aborted."""


_ACCEPTED = object()  # first item of a request's queue once the engine thread has added it


@dataclass
class _Add:
    request_id: str
    prompt: list[int] | str  # token ids, or a PML prompt (prepared by the engine thread: it pins module KV)
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    cache_salt: str | None = None  # ``LLMEngine.add_request``'s isolation arguments (``kvserve/core/isolation.py``)
    namespace: str = GLOBAL_NAMESPACE


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` in the engine thread (Prompt Cache schemas touch the KV pool and the model)."""

    fn: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Tracked:
    """Engine-thread state of one request: where its outputs go, and its latency bookkeeping."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    num_generated: int = 0

    def deliver(self, item: object) -> None:
        _deliver(self.loop, self.queue.put_nowait, item)


def _deliver(loop: asyncio.AbstractEventLoop, callback: Callable[[object], None], arg: object) -> None:
    try:
        loop.call_soon_threadsafe(callback, arg)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """The outputs of one request, as an async iterator; ``abort()`` stops it early. asyncio side only."""

    def __init__(self, owner: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.owner = owner
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    async def wait_accepted(self) -> None:
        """Return once the engine took the request; raise what ``add_request`` raised otherwise."""
        item = await self._queue.get()
        if item is not _ACCEPTED:
            self._close()
            raise item if isinstance(item, BaseException) else RuntimeError(f"unexpected first item {item!r}")

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()  # outputs are cumulative: the newest says it all
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._close()
        return item

    async def result(self) -> RequestOutput:
        """The final output."""
        last = None
        async for output in self:
            last = output
        if last is None:
            raise EngineStepError(f"request {self.request_id} ended without output")
        return last

    def abort(self) -> None:
        """Stop the request and free its KV blocks; a finished request is left alone."""
        if not self.finished:
            self.owner.abort(self.request_id)
            self._close()

    def _close(self) -> None:
        self.finished = True
        self.owner.release(self.request_id)


@dataclass
class _Inbox:
    commands: deque = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    stopping: bool = False


class AsyncEngine:
    """Owns an ``LLMEngine`` and the thread that steps it.

    ``max_queue`` bounds the requests held at once (waiting + running); past it ``add_request``
    raises ``QueueFullError``. Call ``start()`` once, from anywhere; ``shutdown()`` aborts what is left
    and joins the thread.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, max_queue: int | None = None) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.metrics = metrics
        if metrics is not None and engine.parallel_prefill is not None:
            metrics.watch_parallel_prefill(engine.parallel_prefill.state)
        if metrics is not None and engine.tensor_parallel is not None:
            metrics.watch_tensor_parallel(engine.tensor_parallel)
        self.max_queue = max_queue
        self._inbox = _Inbox()
        self._active: set[str] = set()  # asyncio side: requests added and not finished
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.num_step_errors = 0
        self.heap = HeapTrimmer()  # a server runs for days: give the steps' freed activations back

    # ----- lifecycle -----

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._inbox.stopping

    def health_error(self) -> str | None:
        """Why the server cannot take requests (the engine thread stopped, a tensor-parallel rank lost), or None."""
        if not self.is_running:
            return "the engine is not running"
        return self.engine.health_error()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request still in flight (their readers get ``EngineStoppedError``) and stop the thread."""
        with self._inbox.cond:
            self._inbox.stopping = True
            self._inbox.cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ----- asyncio side -----

    @property
    def num_active(self) -> int:
        return len(self._active)

    def check_capacity(self, count: int) -> None:
        """Raise ``QueueFullError`` / ``EngineStoppedError`` unless ``count`` more requests may be queued, and
        ``QueueTooSmallError`` when they never could be."""
        reason = self.health_error()
        if reason is not None:
            raise EngineStoppedError(reason)
        if self.max_queue is not None and count > self.max_queue:
            raise QueueTooSmallError(
                f"the request has {count} prompts, and the server holds at most {self.max_queue} requests at once "
                f"(--max-queue), one per prompt; send at most {self.max_queue} prompts per request"
            )
        if self.max_queue is not None and len(self._active) + count > self.max_queue:
            raise QueueFullError(
                f"the server is busy: {len(self._active)} requests queued or running, the limit (--max-queue) is "
                f"{self.max_queue}; retry later"
            )

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int] | str,
        params: SamplingParams,
        cache_salt: str | None = None,
        namespace: str = GLOBAL_NAMESPACE,
    ) -> RequestStream:
        """Queue a request (token ids or a PML prompt) for the engine thread; await ``wait_accepted()`` on the
        result to see it admitted. ``cache_salt``, ``namespace``: as ``LLMEngine.add_request`` takes them."""
        self.check_capacity(1)
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        loop = asyncio.get_running_loop()
        command = _Add(request_id, prompt, params, loop, queue, time.monotonic(), cache_salt, namespace)
        self._active.add(request_id)
        self._post(command)
        return RequestStream(self, request_id, queue)

    async def add_requests(
        self,
        items: Sequence[tuple[str, Sequence[int] | str, SamplingParams]],
        cache_salt: str | None = None,
        namespace: str = GLOBAL_NAMESPACE,
    ) -> list[RequestStream]:
        """Add several requests (one per prompt) all or none: on any error the others are aborted."""
        self.check_capacity(len(items))
        streams = [self.add_request(*item, cache_salt, namespace) for item in items]
        try:
            for stream in streams:
                await stream.wait_accepted()
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """``fn(engine)`` run in the engine thread between steps; its result, or what it raised."""
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(_Call(fn, loop, future))
        return await future

    def release(self, request_id: str) -> None:
        """A stream ended (finished, failed or aborted): its place in the queue is free again."""
        self._active.discard(request_id)

    def _post(self, command: _Add | _Abort | _Call) -> None:
        with self._inbox.cond:
            self._inbox.commands.append(command)
            self._inbox.cond.notify()

    # ----- engine thread -----

    def _run(self) -> None:
        inbox = self._inbox
        while True:
            with inbox.cond:
                while not inbox.commands and not inbox.stopping and not self.engine.has_unfinished_requests():
                    inbox.cond.wait()
                commands = list(inbox.commands)
                inbox.commands.clear()
                stopping = inbox.stopping
            if stopping:
                self._stop(commands)
                return
            try:
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._observe_engine()
                self.heap.maybe_trim()
            except Exception as exc:  # a bug outside step(): fail what is in flight, never die silently
                get_logger().exception("the engine loop failed; aborting the %d requests in flight", len(self._tracked))
                self._fail_all(EngineStepError(f"the engine failed: {exc!r}"))

    def _stop(self, commands: list[_Add | _Abort | _Call]) -> None:
        stopped = EngineStoppedError("the server is shutting down")
        for command in commands:
            if isinstance(command, _Add):
                _Tracked(command.loop, command.queue, command.arrival, 0).deliver(stopped)
            elif isinstance(command, _Call):
                _deliver(command.loop, _settle, (command.future, None, stopped))
        self._fail_all(stopped, reason="abort")
        self._observe_engine()

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Call):
            try:
                _deliver(command.loop, _settle, (command.future, command.fn(self.engine), None))
            except Exception as exc:
                _deliver(command.loop, _settle, (command.future, None, exc))
            return
        if isinstance(command, _Abort):
            tracked = self._tracked.pop(command.request_id, None)
            self._guarded_abort(command.request_id)
            if tracked is not None and self.metrics is not None:
                self.metrics.on_finish(time.monotonic() - tracked.arrival, "abort")
            return
        tracked = _Tracked(command.loop, command.queue, command.arrival, 0)
        try:
            self.engine.add_request(
                command.prompt, command.params, request_id=command.request_id, cache_salt=command.cache_salt,
                namespace=command.namespace,
            )  # fmt: skip
        except Exception as exc:  # ValueError for a bad request; anything else is reported the same way
            tracked.deliver(exc)
            return
        tracked.num_prompt_tokens = len(self.engine.requests[command.request_id].prompt_token_ids)
        self._tracked[command.request_id] = tracked
        tracked.deliver(_ACCEPTED)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.num_step_errors += 1
            get_logger().exception("engine step failed; aborting the %d requests in flight", len(self._tracked))
            self._fail_all(EngineStepError(f"the engine failed while running this request: {exc!r}"))
            return
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            self._record(tracked, output, now)
            if output.finished:
                del self._tracked[output.request_id]
            item = output if output.error is None else EngineStepError(output.error)  # this request alone failed
            batches.setdefault(tracked.loop, []).append((tracked.queue, item))
        for loop, items in batches.items():  # one wake-up of the event loop per step, not one per request
            _deliver(loop, _put_all, items)

    def _record(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        total = sum(len(o.token_ids) for o in output.outputs)
        new = total - tracked.num_generated
        if new > 0:
            tracked.num_generated = total
            if self.metrics is not None:
                if tracked.last_token_time is None:
                    self.metrics.on_first_token(now - tracked.arrival, tracked.num_prompt_tokens)
                since = None if tracked.last_token_time is None else now - tracked.last_token_time
                self.metrics.on_tokens(new, since)
            tracked.last_token_time = now
        if output.finished and self.metrics is not None:
            reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
            self.metrics.on_finish(now - tracked.arrival, reasons[0] if reasons else "stop")

    def _fail_all(self, exc: Exception, reason: str = "error") -> None:
        now = time.monotonic()
        for request_id, tracked in list(self._tracked.items()):
            self._guarded_abort(request_id)
            tracked.deliver(exc)
            if self.metrics is not None:
                self.metrics.on_finish(now - tracked.arrival, reason)
        self._tracked.clear()
        for request_id in list(self.engine.requests):  # anything left that nobody tracks
            self._guarded_abort(request_id)
        scheduler = self.engine.scheduler
        for request in [*scheduler.waiting, *scheduler.running, *scheduler.swapped]:  # never step them again
            try:
                scheduler.finish(request)
            except Exception:
                get_logger().exception("dropping request %s failed", request.request_id)

    def _guarded_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # a failed step can leave a request half-updated; drop it from the engine regardless
            get_logger().exception("aborting request %s failed", request_id)
            self.engine.requests.pop(request_id, None)

    def _observe_engine(self) -> None:
        if self.metrics is None:
            return
        scheduler, usage, kv = self.engine.scheduler, self.engine.kv_usage(), self.engine.kv
        store = self.engine.prompt_cache.store
        idle = not (scheduler.running or scheduler.waiting or scheduler.swapped)
        self.metrics.observe_engine(
            EngineSnapshot(
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_swapped=len(scheduler.swapped),
                kv_usage=usage.usage,
                prefix_query_tokens=usage.prefix_query_tokens,
                prefix_hit_tokens=usage.prefix_hit_tokens,
                num_preemptions=scheduler.num_preemptions,
                prompt_cache_modules=len(store.modules),
                prompt_cache_bytes=store.memory_bytes(),
                prompt_cache_encoded_tokens=store.stats.encoded_tokens,
                prompt_cache_evictions=store.stats.evictions,
                **offload_counters(self.engine),
                kv_request_sequences=kv.num_request_sequences(),
                kv_leaked_blocks=kv.leaked_blocks() if idle else None,
                faults_injected=sum(faults.injected.values()),
            )
        )


def _settle(item: tuple[asyncio.Future, object, Exception | None]) -> None:
    future, result, error = item
    if future.done():  # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

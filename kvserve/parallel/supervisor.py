"""Keeps a prefill group running: a lost group is closed and, for a local one, started again with backoff.

A group is lost when a prefill over it fails (a worker died, hung past the timeout or raised) or when a
thread of the supervisor's own, looking at the worker processes every ``poll_s``, finds one gone while
the group is idle. Meanwhile the engine prefills in its own process, so nothing waits for the restart. A
new group starts ``first_delay_s`` after a loss; each further failure without a successful parallel
prefill in between (a lost group, or a start that did not come up) doubles the delay, up to
``max_delay_s``, so a group that cannot start costs one attempt a minute, not a loop. A joined
(torchrun-style) group has no ``start``: its workers are not ours to restart, so a lost one stays off.

The engine holds the lock for a whole prefill; the thread takes it only to look and to swap groups, and
starts a group without it (loading the model takes seconds).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from kvserve.errors import ParallelPrefillError
from kvserve.log import get_logger


class Group(Protocol):
    workers: list
    closed: bool

    def close(self) -> None: ...


@dataclass(frozen=True)
class GroupState:
    """What ``/metrics`` shows about the group."""

    state: str  # "up": prefills run over it; "restarting": lost, a new one is due or starting; "off": stays off
    workers: int  # worker processes a running group has (P - 1)
    workers_alive: int  # worker processes of the running group alive now (0 while restarting)
    restarts: int  # groups started again after a loss
    failures: int  # groups lost, and restarts that did not come up


class GroupSupervisor:
    """Owns the group; ``held()`` lends it to a prefill. ``start(cancel)`` builds a new group (None: never)."""

    def __init__(
        self,
        group: Group,
        num_workers: int,
        start: Callable[[threading.Event], Group] | None = None,
        first_delay_s: float = 1.0,
        max_delay_s: float = 60.0,
        poll_s: float = 0.5,
    ) -> None:
        self.group: Group | None = group
        self.num_workers = num_workers
        self._start = start
        self.first_delay_s, self.max_delay_s = first_delay_s, max_delay_s
        self._lock = threading.RLock()  # re-entrant: a searched partition prefills inside a prefill
        self._closing = threading.Event()
        self.starting = False  # a new group is being started (in the thread)
        self.restart_at: float | None = None  # when the next start is due (monotonic), None: none due
        self.streak = 0  # failures since the last successful prefill: the backoff's exponent
        self.restarts = 0
        self.failures = 0
        # The thread holds only a weak reference, so an engine dropped without close() is still collected.
        self._thread = threading.Thread(
            target=_watch, args=(weakref.ref(self), self._closing, poll_s), name="kvserve-prefill-supervisor",
            daemon=True,
        )  # fmt: skip
        weakref.finalize(self, self._closing.set)
        self._thread.start()

    @contextmanager
    def held(self) -> Iterator[Group]:
        """The running group, held; ParallelPrefillError if there is none. A ParallelPrefillError raised in the
        block loses the group (a new one starts later) and propagates."""
        with self._lock:
            if self.group is None or self._closing.is_set():
                raise ParallelPrefillError(f"the prefill group is not running ({self.state().state})")
            try:
                yield self.group
            except ParallelPrefillError as exc:
                self.lose(str(exc))
                raise
            self.streak = 0

    def lose(self, reason: str) -> None:
        """Close the running group (if still there) and schedule the next start."""
        with self._lock:
            if self.group is None:
                return
            self.group.close()
            self.group = None
            self._failed()
        when = "stays off" if self.restart_at is None else f"restarting in {self.restart_at - time.monotonic():.0f} s"
        get_logger().error("parallel prefill failed, falling back to single-process prefill (%s): %s", when, reason)

    def _failed(self) -> None:
        self.failures += 1
        self.streak += 1
        if self._start is not None and not self._closing.is_set():
            delay = min(self.first_delay_s * 2 ** (self.streak - 1), self.max_delay_s)
            self.restart_at = time.monotonic() + delay

    def state(self) -> GroupState:
        group = self.group
        if group is None:
            state = "restarting" if self.restart_at is not None or self.starting else "off"
            return GroupState(state, self.num_workers, 0, self.restarts, self.failures)
        # A joined group's workers run elsewhere: counted alive while it is up.
        alive = sum(w.is_alive() for w in group.workers) if group.workers else self.num_workers
        # A dead worker the thread has not looked at yet already means prefills fall back: not up.
        state = "up" if alive == self.num_workers else "restarting"
        return GroupState(state, self.num_workers, alive, self.restarts, self.failures)

    def tick(self) -> None:
        """One look: lose a group with a dead worker, or start a new one when it is due."""
        with self._lock:
            if self.group is not None:
                if self.group.closed or any(not w.is_alive() for w in self.group.workers):
                    self.lose(f"a prefill worker exited ({_exit_codes(self.group)})")
                return
            if self.restart_at is None or time.monotonic() < self.restart_at:
                return
            self.restart_at = None
            self.starting = True
        try:
            self._restart()
        finally:
            self.starting = False

    def _restart(self) -> None:
        """Start a group (without the lock: this takes seconds) and install it, or schedule the next try."""
        try:
            group = self._start(self._closing)
        except Exception as exc:  # any failed start (a spawn or a port can fail too) is retried the same way
            if self._closing.is_set():  # cancelled by close(): nothing went wrong
                return
            with self._lock:
                self._failed()
                retry = "" if self.restart_at is None else f"; next try in {self.restart_at - time.monotonic():.0f} s"
            get_logger().error("parallel prefill group did not restart: %s%s", exc, retry)
            return
        with self._lock:
            if self._closing.is_set():
                group.close()
                return
            self.group = group
            self.restarts += 1
        get_logger().info("parallel prefill group restarted (restart %d)", self.restarts)

    def close(self, timeout_s: float = 90.0) -> None:
        """Stop the thread (cancelling a start under way) and close the group. Idempotent."""
        self._closing.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        with self._lock:
            self.restart_at = None
            if self.group is not None:
                self.group.close()
                self.group = None


def _watch(ref: weakref.ref[GroupSupervisor], closing: threading.Event, poll_s: float) -> None:
    while not closing.wait(poll_s):
        supervisor = ref()
        if supervisor is None:
            return
        try:
            supervisor.tick()
        except Exception:  # a bug here must not end the watching silently
            get_logger().exception("the parallel prefill supervisor failed a check")
        del supervisor  # no strong reference while waiting


def _exit_codes(group: Group) -> str:
    return ", ".join(f"{w.name}: exit code {w.exitcode}" for w in group.workers if not w.is_alive()) or "closed"

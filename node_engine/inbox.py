"""The engine thread's inbox: requests, aborts and control calls posted from the event loop, taken between
two steps.

Closing it (the engine stops, or failed) is atomic with posting: once
:meth:`Inbox.close` has run, every post is refused to its poster, who answers
it, and ``close`` hands back what was still queued so the engine answers that.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

from node_engine.request import Request


@dataclass
class Add:
    request: Request


@dataclass
class Abort:
    rid: str | None  # None: all


@dataclass
class Call:
    """``fn`` to run on the engine thread; its result or exception goes to ``future`` on ``loop``."""

    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def resolve(self, result: Any) -> None:
        self.loop.call_soon_threadsafe(_set_result, self.future, result)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


Item = Union[Add, Abort, Call]


@dataclass(frozen=True)
class Closed:
    """Why the inbox takes nothing more: the engine is stopping, or it failed."""

    message: str
    has_failed: bool


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()  # None: wake the thread to stop
        self._lock = threading.Lock()  # orders a post against the closing
        self._batch: deque[Item] = deque()  # taken from the queue, not handed to the engine thread yet
        self.closed: Closed | None = None

    def post(self, item: Item) -> Closed | None:
        """Queue ``item``; if the inbox is closed, nothing is queued and why is returned (any thread)."""
        with self._lock:
            if self.closed is None:
                self._queue.put(item)
            return self.closed

    def wake(self) -> None:
        """End a blocking :meth:`take` (the engine is stopping)."""
        self._queue.put(None)

    def take(self, *, block: bool) -> Iterator[Item]:
        """What is queued, in order (waiting for a first item if ``block``), up to a wake-up: taken at once,
        handed out one at a time. What the caller was not handed yet when it stopped (it failed handling one) is
        still the inbox's: :meth:`close` hands it back, so the engine answers it."""
        batch = self._batch
        try:
            item = self._queue.get(block=block)
            while item is not None:
                batch.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass  # all taken
        while batch:
            yield batch.popleft()

    def hand_back(self, item: Item) -> None:
        """An item the caller was handed and failed to handle, for :meth:`close` to hand back first (engine
        thread)."""
        self._batch.appendleft(item)

    def close(self, closed: Closed) -> list[Item]:
        """Take nothing more; returns what was still queued (first what was taken and never handled), for the
        engine to answer."""
        with self._lock:
            self.closed = closed
        left: list[Item] = list(self._batch)  # taken, never handled: they came before anything still queued
        self._batch.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return left
            if item is not None:
                left.append(item)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

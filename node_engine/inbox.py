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
from dataclasses import dataclass
from typing import Any, Callable, Union

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

    def take(self, *, block: bool) -> list[Item]:
        """What is queued, in order (waiting for a first item if ``block``); stops at a wake-up."""
        items: list[Item] = []
        try:
            item = self._queue.get(block=block)
            while item is not None:
                items.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass  # all taken
        return items

    def close(self, closed: Closed) -> list[Item]:
        """Take nothing more; returns what was still queued, for the engine to answer."""
        with self._lock:
            self.closed = closed
        left: list[Item] = []
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

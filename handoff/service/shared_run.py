"""One run of a coroutine shared by every caller that asks while it runs: :class:`SharedRun`.

For work a stranger can ask for again and again at no cost to itself (a
scrape of the engine's metrics behind an unauthenticated ``/metrics``):
concurrent asks cost one run, not one each.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


class SharedRun(Generic[T]):
    """``await shared()`` runs ``work`` unless a run is under way, whose result (or exception) it shares.

    A caller that is cancelled (its client left) stops waiting; the run goes on for the others. A call after a
    run has ended starts a new one: nothing is cached past the run."""

    def __init__(self, work: Callable[[], Awaitable[T]]) -> None:
        self._work = work
        self._running: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._work())
        return await asyncio.shield(self._running)

"""Blocking work that may never return (a checkpoint read on a hung mount, a group join with a trainer that
never comes) on a thread of its own, awaited with a deadline.

Rules:

- The work runs on a new daemon thread, never on the engine thread or the
  event loop (the engine's checkpoint reads and weight-group calls, the
  sidecar's checkpoint checks); what it does must release the GIL while it blocks (system calls,
  torch.distributed calls), so a stalled call holds nothing but its thread.
- Past the deadline the caller gets :class:`Overdue` at once; the work is told
  through its ``cancel`` event and its result, when it comes, is dropped.
- A thread still blocked after its deadline counts as stuck. At most
  ``max_stuck`` may be stuck at a time: a new call past that is refused at
  once (:class:`TooManyStuck`), so hung storage costs a bounded number of threads.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

DEFAULT_MAX_STUCK = 4


class Overdue(Exception):
    """The work did not finish within its deadline."""


class TooManyStuck(Exception):
    """Too many earlier calls are still blocked past their deadlines."""


class Aborted(Exception):
    """The caller's ``abort`` event was set before the work finished."""


class _Call(Generic[T]):
    def __init__(self, work: Callable[[threading.Event], T], loop: asyncio.AbstractEventLoop,
                 discard: Callable[[T], None] | None = None) -> None:
        self.cancel = threading.Event()
        self.discard = discard
        self.future: asyncio.Future[T] = loop.create_future()
        self._work = work
        self._loop = loop
        self.thread = threading.Thread(target=self._run, name="bounded-work", daemon=True)

    def _run(self) -> None:
        try:
            result = self._work(self.cancel)
        except BaseException as exc:  # handed to the awaiting coroutine
            self._hand_over(None, exc)
        else:
            self._hand_over(result, None)

    def _hand_over(self, result: object, exc: BaseException | None) -> None:
        if self._loop.is_closed():
            return  # a late result after the loop ended: nobody waits for it
        try:
            self._loop.call_soon_threadsafe(_settle, self.future, result, exc, self.discard)
        except RuntimeError:
            return  # the loop closed between the check and the call


def _settle(future: asyncio.Future, result: object, exc: BaseException | None,
            discard: Callable[[object], None] | None) -> None:
    if future.done():
        if exc is None and discard is not None:
            discard(result)  # the caller gave up after the work's own last look at ``cancel``
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class BoundedThreads:
    """Runs blocking work with a deadline; keeps count of the threads that overran theirs."""

    def __init__(self, max_stuck: int = DEFAULT_MAX_STUCK) -> None:
        self.max_stuck = max_stuck
        self._stuck: list[threading.Thread] = []

    @property
    def num_stuck(self) -> int:
        self._stuck = [thread for thread in self._stuck if thread.is_alive()]
        return len(self._stuck)

    async def run(self, work: Callable[[threading.Event], T], timeout_s: float,
                  abort: asyncio.Event | None = None, discard: Callable[[T], None] | None = None) -> T:
        """``work(cancel)`` on its own thread; its result, its exception, :class:`Overdue` after ``timeout_s``, or
        :class:`Aborted` as soon as ``abort`` is set. ``discard`` (on the event loop) gets a result that came
        after the caller gave up."""
        if self.num_stuck >= self.max_stuck:
            raise TooManyStuck(f"{self.num_stuck} earlier call(s) are still blocked past their deadlines")
        call = _Call(work, asyncio.get_running_loop(), discard)
        call.thread.start()
        aborted = asyncio.ensure_future(abort.wait()) if abort is not None else None
        try:
            waiting = {call.future} if aborted is None else {call.future, aborted}
            done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if call.future in done:
                return call.future.result()
            self._give_up(call)
            if aborted is not None and aborted in done:
                raise Aborted("aborted before it finished")
            raise Overdue(f"not done within {timeout_s:g} s")
        except asyncio.CancelledError:
            self._give_up(call)
            raise
        finally:
            if aborted is not None:
                aborted.cancel()

    def _give_up(self, call: _Call) -> None:
        call.cancel.set()
        call.future.cancel()  # a late result is dropped
        if call.thread.is_alive():
            self._stuck.append(call.thread)

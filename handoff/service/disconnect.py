"""Noticing that the client of a request went away while we wait on something else.

:class:`DisconnectWatch` is the one mechanism: it cancels the task serving the
request when the client disconnects. Cancelling the serving task cancels
whatever it awaits (an upstream call, a queue), and an upstream connection
closed that way is how a node or an engine learns to abort. Under handoff's
own server protocol (:mod:`handoff.service.http_protocol`) the request's scope
carries a :class:`DisconnectNotice` the protocol fires when the connection is
lost; under any other ASGI server a watcher task waits on ``receive()``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.types import Receive, Scope

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's status for "the client went away first": never sent, only logs and metrics see it
NOTICE_EXTENSION = "handoff.disconnect_notice"  # the scope["extensions"] key of a request's DisconnectNotice


class ClientGone(Exception):
    """The client disconnected before the awaited work finished (the work was cancelled)."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (call only after the body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectNotice:
    """One request's "the connection was lost", fired by the server: callbacks added run once, then (or at
    once, added after it).

    ``on_watch`` runs when a callback is added: the server resumes reading the connection there, which its
    flow control may have paused while the body came in, so that a client leaving is seen at all (a watcher
    task on ``receive()`` did the same by calling it)."""

    __slots__ = ("is_lost", "_callbacks", "_on_watch")

    def __init__(self, on_watch: Callable[[], None] | None = None) -> None:
        self.is_lost = False
        self._callbacks: list[Callable[[], None]] = []
        self._on_watch = on_watch

    def add(self, callback: Callable[[], None]) -> None:
        if self.is_lost:
            callback()
            return
        self._callbacks.append(callback)
        if self._on_watch is not None:
            self._on_watch()

    def discard(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def lost(self) -> None:
        if self.is_lost:
            return
        self.is_lost = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class DisconnectWatch:
    """While active, a client disconnect cancels the task that serves the request.

    Start it after the request body was read (without the server's
    :class:`DisconnectNotice` in ``scope`` it consumes ``receive``); call
    :meth:`finish` before the last body message is sent and :meth:`stop` when
    done. A cancellation it caused is recognised with :attr:`is_disconnected`
    and swallowed with :meth:`absorb_cancel`.
    """

    def __init__(self, receive: Receive, scope: Scope | None = None) -> None:
        self._task = asyncio.current_task()
        self.is_disconnected = False
        self._is_finished = False
        self._notice: DisconnectNotice | None = None
        self._watcher: asyncio.Future[None] | None = None
        notice = scope.get("extensions", {}).get(NOTICE_EXTENSION) if scope is not None else None
        if isinstance(notice, DisconnectNotice):
            self._notice = notice
            notice.add(self._client_left)
        else:
            self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        await wait_for_disconnect(receive)
        self._client_left()

    def _client_left(self) -> None:
        if not self._is_finished and self._task is not None:
            self.is_disconnected = True
            self._task.cancel()

    def finish(self) -> None:
        """The response is complete: from now on a disconnect is the normal end."""
        self._is_finished = True

    def stop(self) -> None:
        self._is_finished = True
        if self._notice is not None:
            self._notice.discard(self._client_left)
        if self._watcher is not None:
            self._watcher.cancel()

    def absorb_cancel(self) -> None:
        """Swallow the cancellation this watch caused (the task goes on to clean up and return)."""
        if self._task is not None:
            self._task.uncancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client leaves first, it is cancelled and :class:`ClientGone` is raised."""
    watch = DisconnectWatch(request.receive, request.scope)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.is_disconnected:
            raise
        watch.absorb_cancel()
        raise ClientGone() from None
    finally:
        watch.stop()

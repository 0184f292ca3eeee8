"""A request of :class:`~handoff.service.upstream.UpstreamClient` on its way: sent first, its answer awaited later.

:meth:`UpstreamClient.start` writes a request at once on an idle pooled
connection (or starts connecting in the background) and returns a
:class:`PendingRequest`; :meth:`PendingRequest.response` waits for the answer.
A fan-out starts every node's request in one pass and then reads the answers
in one coroutine, as :meth:`PendingRequest.call_when_answered` reports them
in: no task per node. :meth:`UpstreamClient.request` is ``start`` then
``response``, so both follow the same rules (one deadline for the whole
exchange, the one retry on a fresh connection after a stale keep-alive).

"Answered" means that reading the answer now waits for no peer: the response
is complete, or failed, or holds at least the bytes the reader will take
(``answer_caps``: a capped read of a 2xx answer, and of any other). A started
request that meets a stale keep-alive connection makes its one retry in the
background and is answered once the retry is, so a reader of answered
requests never waits on one.

A pending request is settled once: by :meth:`PendingRequest.response`
(returning the response, which then owns the connection, or raising), or by
:meth:`PendingRequest.close`, which abandons it (its connection closed, a
connect under way stopped).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from handoff.service.http1 import Connection
from handoff.service.http1_request import Origin
from handoff.service.upstream_errors import ConnectionDropped
from handoff.service.upstream_response import UpstreamResponse

__all__ = ["PendingRequest"]

log = logging.getLogger(__name__)

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})  # RFC 9110 9.2.2

TakeIdle = Callable[[Origin], "Connection | None"]
Connect = Callable[[Origin, str, "float | None"], Awaitable[Connection]]


class PendingRequest:
    """One request, written now or as soon as its connection is up; :meth:`response` once, or :meth:`close`."""

    __slots__ = ("method", "url", "_origin", "_head", "_body", "_deadline", "_connect", "_release", "_answer_caps",
                 "_conn", "_connecting", "_is_written", "_is_retry", "_is_settled", "_on_answer")

    def __init__(self, method: str, url: str, origin: Origin, head: bytes, body: bytes, deadline: float | None, *,
                 take_idle: TakeIdle, connect: Connect, release: Callable[[Connection], None],
                 connect_now: bool, answer_caps: tuple[int, int] | None = None) -> None:
        self.method = method
        self.url = url
        self._origin = origin
        self._head = head
        self._body = body
        self._deadline = deadline
        self._connect = connect
        self._release = release
        self._answer_caps = answer_caps
        self._conn: Connection | None = None
        self._connecting: asyncio.Future[None] | None = None  # connecting, then sending, in the background
        self._is_written = False
        self._is_retry = False
        self._is_settled = False
        self._on_answer: Callable[[], None] | None = None
        conn = take_idle(origin)
        if conn is not None:
            self._send(conn)
        elif connect_now:
            self._connect_in_background()

    # -- answered yet? -------------------------------------------------------------
    @property
    def is_answered(self) -> bool:
        """Whether :meth:`response` and a capped read of its body would wait for no peer."""
        if self._is_settled:
            return True
        connecting = self._connecting
        if connecting is not None:
            if not connecting.done():
                return False
            if connecting.cancelled() or connecting.exception() is not None:
                return True
        conn = self._conn
        return conn is not None and conn.has_answer

    def call_when_answered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once :attr:`is_answered` (now, if it already is); a later call replaces it."""
        if self.is_answered:
            self._on_answer = None
            callback()
        else:
            self._on_answer = callback

    def _answered(self) -> None:
        callback, self._on_answer = self._on_answer, None
        if callback is not None:
            callback()

    def _on_connection_answer(self) -> None:
        """The connection has its answer; a stale keep-alive connection is retried first, in the background."""
        conn = self._conn
        if conn is not None and self._is_stale(conn) and not self._is_settled:
            conn.close()
            self._is_retry = True
            self._conn = None
            log.debug("retrying %s %s on a fresh connection (stale keep-alive)", self.method, self.url)
            self._connect_in_background()
            return
        self._answered()

    def _is_stale(self, conn: Connection) -> bool:
        """The connection was a reused one the peer closed as the request went out, and the peer cannot have
        acted on it: nothing was written, or an idempotent request got no byte back. One retry, never two."""
        could_not_have_acted = not self._is_written or (conn.num_response_bytes == 0
                                                        and self.method in IDEMPOTENT_METHODS)
        return (not self._is_retry and conn.is_reused and isinstance(conn.failure, ConnectionDropped)
                and could_not_have_acted)

    # -- sending -------------------------------------------------------------------
    def _send(self, conn: Connection) -> None:
        self._conn = conn
        self._is_written = conn.send(self.url, self.method, self._head, self._body, self._deadline,
                                     answer_caps=self._answer_caps)
        conn.call_when_answered(self._on_connection_answer)

    def _connect_in_background(self) -> None:
        self._connecting = asyncio.ensure_future(self._connect_then_send())
        self._connecting.add_done_callback(self._on_connect_done)

    async def _connect_then_send(self) -> None:
        conn = await self._connect(self._origin, self.url, self._deadline)
        if self._is_settled:  # abandoned while it connected
            conn.close()
            return
        self._send(conn)

    def _on_connect_done(self, connecting: asyncio.Future[None]) -> None:
        # looking at the failure marks it seen: it is response()'s to raise, or nobody's if the request is abandoned
        if connecting.cancelled() or connecting.exception() is not None:
            self._answered()

    # -- the answer ------------------------------------------------------------------
    async def response(self) -> UpstreamResponse:
        """The response once its headers arrived. Raises an :class:`UpstreamError` subclass, whatever the peer
        does; a request abandoned (cancelled, closed) leaves no connection behind."""
        if self._is_settled:
            raise RuntimeError(f"the request to {self.url} was already answered or abandoned")
        try:
            response = await self._receive()
        except BaseException:
            self.close()
            raise
        self._is_settled = True  # the response owns the connection now
        return response

    async def _receive(self) -> UpstreamResponse:
        while True:
            if self._connecting is not None:
                await self._connecting
                self._connecting = None
            conn = self._conn
            if conn is None:
                conn = await self._connect(self._origin, self.url, self._deadline)
                self._send(conn)
            try:
                if not self._is_written:
                    raise ConnectionDropped(f"{self._origin.host_header} closed the connection before the request",
                                            url=self.url)
                await conn.receive_headers()
            except ConnectionDropped:
                if self._conn is not conn:  # retried in the background meanwhile (a started request)
                    continue
                is_stale = self._is_stale(conn)
                conn.close()
                if is_stale:
                    log.debug("retrying %s %s on a fresh connection (stale keep-alive)", self.method, self.url)
                    self._is_retry = True
                    self._conn = None
                    continue
                raise
            return UpstreamResponse(self.url, conn, self._release)

    def close(self) -> None:
        """Abandon the request (safe to call again, and after :meth:`response`, when it does nothing)."""
        if self._is_settled:
            return
        self._is_settled = True
        self._on_answer = None
        connecting, self._connecting = self._connecting, None
        if connecting is not None and not connecting.done():
            connecting.cancel()
        if self._conn is not None:
            self._conn.close()

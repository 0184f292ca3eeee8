"""One HTTP/1.1 connection of :mod:`handoff.service.upstream`: an asyncio Protocol, one exchange at a time.

A :class:`Connection` feeds what arrives to a :class:`ResponseParser`
straight from ``data_received`` and wakes the reader waiting on it. Its owner
(the pool) hears of its end through ``on_closed``. Bytes that arrive when no
response is expected (on an idle connection, or after the response) close it:
such a connection can never carry another exchange.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import Callable

from handoff.service.http1_parser import (
    DEFAULT_MAX_FIELDS,
    DEFAULT_MAX_HEAD_BYTES,
    MalformedResponse,
    ResponseParser,
)
from handoff.service.http1_request import Origin
from handoff.service.upstream_errors import (
    ConnectionDropped,
    ProtocolError,
    UpstreamError,
    UpstreamTimeout,
)

_HIGH_WATER_BYTES = 256 * 1024
_LOW_WATER_BYTES = 64 * 1024


Write = Callable[[asyncio.Transport, bytes], None]


def write_now(transport: asyncio.Transport, data: bytes) -> None:
    transport.write(data)


class ConnState(enum.Enum):
    BUSY = "busy"      # one exchange in progress
    IDLE = "idle"      # in the pool, waiting for the next request
    CLOSED = "closed"  # transport closed; never used again


class Connection(asyncio.Protocol):
    """One TCP connection: the protocol callbacks and one exchange at a time.

    ``max_head_bytes`` and ``max_fields`` cap every response head (see
    :class:`ResponseParser`); past them the exchange fails with :class:`ProtocolError`.
    """

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop,
                 on_closed: Callable[[Connection], None], *, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 max_fields: int = DEFAULT_MAX_FIELDS, write: Write = write_now) -> None:
        """``write(transport, data)`` puts a request's bytes on the wire (the pool may hold them back a moment:
        :meth:`UpstreamClient.start_many <handoff.service.upstream.UpstreamClient.start_many>`)."""
        self.origin = origin
        self._write = write
        self.state = ConnState.BUSY
        self.is_reused = False
        self.idle_since = 0.0
        self.transport: asyncio.Transport | None = None
        self._loop = loop
        self._on_closed = on_closed
        self._max_head_bytes = max_head_bytes
        self._max_fields = max_fields
        self._url = ""
        self.deadline: float | None = None  # the exchange's, on the loop's clock
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.is_headers_done = False
        self.is_message_done = False
        self.is_keep_alive = False
        self.num_response_bytes = 0
        self._chunks: deque[bytes] = deque()
        self._parser: ResponseParser | None = None  # made when the request is sent
        self._num_buffered = 0
        self._is_reading_paused = False
        self._failure: UpstreamError | None = None
        self._on_answer: Callable[[], None] | None = None
        self._answer_caps: tuple[int, int] | None = None

    # -- lifecycle ---------------------------------------------------------
    def _transition(self, new: ConnState, *, allowed_from: tuple[ConnState, ...]) -> None:
        if self.state not in allowed_from:
            raise RuntimeError(f"connection to {self.origin.host_header} is {self.state.value}, "
                               f"cannot become {new.value}")
        self.state = new

    def mark_idle(self) -> None:
        self._transition(ConnState.IDLE, allowed_from=(ConnState.BUSY,))
        self.idle_since = self._loop.time()

    def mark_busy(self) -> None:
        self._transition(ConnState.BUSY, allowed_from=(ConnState.IDLE,))
        self.is_reused = True
        self._reset_exchange()

    @property
    def is_drained(self) -> bool:
        """The response is complete, without error, and the reader took every byte."""
        return self.is_message_done and not self._chunks and self._failure is None

    @property
    def has_answer(self) -> bool:
        """A reader of whole (capped) answers would wait for nothing: the response is complete, or failed, or
        holds what the reader will take (the exchange's ``answer_caps``, or a full read buffer)."""
        if self.is_message_done or self._failure is not None or self._is_reading_paused:
            return True
        if self.state is ConnState.CLOSED:
            return True
        caps = self._answer_caps
        if caps is None or not self.is_headers_done:
            return False
        return self._num_buffered >= (caps[0] if 200 <= self.status < 300 else caps[1])

    @property
    def failure(self) -> UpstreamError | None:
        """Why the exchange failed, once it has."""
        return self._failure

    def call_when_answered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once :attr:`has_answer` (now, if it already is); a later call replaces it."""
        if self.has_answer:
            callback()
        else:
            self._on_answer = callback

    def is_fresh_enough(self, now: float, max_idle_s: float) -> bool:
        return (self.state is ConnState.IDLE and self.transport is not None
                and not self.transport.is_closing() and now - self.idle_since < max_idle_s)

    def close(self) -> None:
        """Close now (abort: unread data is dropped); safe to call twice.

        A reader still waiting on this exchange gets :class:`ConnectionDropped`.
        """
        if self.state is ConnState.CLOSED:
            return
        if self.state is ConnState.BUSY and not self.is_message_done and self._failure is None:
            self._failure = ConnectionDropped(f"connection to {self.origin.host_header} was closed by this client",
                                              url=self._url)
            self._wake()
        self.state = ConnState.CLOSED
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()
        self._on_closed(self)

    # -- sending -----------------------------------------------------------
    def send(self, url: str, method: str, head: bytes, body: bytes, deadline: float | None, *,
             answer_caps: tuple[int, int] | None = None) -> bool:
        """Write one request; False when the transport was already closed (nothing written). ``answer_caps``:
        the body bytes its reader takes of a 2xx answer and of any other (:attr:`has_answer` counts them)."""
        self._url = url
        self._answer_caps = answer_caps
        if self.transport is None or self.transport.is_closing() or self.state is not ConnState.BUSY:
            return False
        self._parser = ResponseParser(self._chunks, is_head_request=method == "HEAD",
                                      max_head_bytes=self._max_head_bytes, max_fields=self._max_fields)
        self.deadline = deadline
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._on_deadline)
        if len(body) <= 65536:
            self._write(self.transport, head + body)
        else:
            self._write(self.transport, head)
            self._write(self.transport, body)
        return True

    # -- asyncio.Protocol --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self.state is not ConnState.BUSY or parser is None or self.is_message_done:
            self.close()  # bytes nobody asked for: the connection cannot be trusted for another request
            return
        self.num_response_bytes += len(data)
        try:
            num_body_bytes = parser.feed(data)
        except MalformedResponse as exc:
            self._fail(ProtocolError(f"invalid HTTP response from {self.origin.host_header}: {exc}",
                                     url=self._url), exc)
            return
        is_news = bool(num_body_bytes)  # the reader is woken once per piece, for all it brought
        if not self.is_headers_done and parser.is_head_done:
            self.status = parser.status
            self.headers = parser.headers
            self.is_headers_done = is_news = True
        if num_body_bytes:
            self._num_buffered += num_body_bytes
            if self._num_buffered > _HIGH_WATER_BYTES and not self._is_reading_paused and self.transport:
                self._is_reading_paused = True
                self.transport.pause_reading()
        if parser.is_done:
            self.is_keep_alive = parser.is_keep_alive and not parser.has_trailing_bytes
            self._complete()
            if parser.has_trailing_bytes:
                self.close()  # a second answer nobody asked for: never hand it to the next request
        elif is_news:
            self._wake()

    def eof_received(self) -> bool | None:
        parser = self._parser
        if self.state is ConnState.BUSY and parser is not None and not self.is_message_done:
            if parser.feed_eof():
                self.is_keep_alive = False
                self._complete()  # a body delimited by the close
            else:  # no answer can come: failed now (the transport's close first flushes a body nobody may read)
                self._dropped(None)
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is ConnState.BUSY and not self.is_message_done and self._failure is None:
            self._dropped(exc)
        if self.state is not ConnState.CLOSED:
            self.state = ConnState.CLOSED
            self._cancel_timer()
            self._on_closed(self)

    # -- waiting (called by UpstreamResponse / UpstreamClient) -------------
    async def receive_headers(self) -> None:
        while not self.is_headers_done:
            if self._failure is not None:
                raise self._failure
            await self._wait()

    async def receive_chunk(self) -> bytes:
        """Every body byte that arrived since the last call (waiting for some); ``b""`` at the end."""
        while True:
            if self._chunks:
                # joining what already arrived costs nothing in latency and saves a relay write per piece
                chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._num_buffered -= len(chunk)
                if self._is_reading_paused and self._num_buffered < _LOW_WATER_BYTES and self.transport:
                    self._is_reading_paused = False
                    self.transport.resume_reading()
                return chunk
            if self._failure is not None:
                raise self._failure
            if self.is_message_done:
                return b""
            await self._wait()

    async def _wait(self) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._on_answer is not None and self.has_answer:
            callback, self._on_answer = self._on_answer, None
            callback()

    def _complete(self) -> None:
        self.is_message_done = True
        self._cancel_timer()
        self._wake()

    def _fail(self, error: UpstreamError, cause: BaseException | None) -> None:
        if self._failure is None:
            error.__cause__ = cause
            self._failure = error
        self._wake()
        self.close()

    def _dropped(self, exc: Exception | None) -> None:
        what = "before the response headers" if not self.is_headers_done else "in the response body"
        reason = f": {exc}" if exc else ""
        self._fail(ConnectionDropped(f"{self.origin.host_header} closed the connection {what}{reason}",
                                     url=self._url), exc)

    def _on_deadline(self) -> None:
        self._timer = None
        if not self.is_message_done:
            what = "the response headers" if not self.is_headers_done else "the rest of the response body"
            self._fail(UpstreamTimeout(f"{self.origin.host_header} did not send {what} in time",
                                       url=self._url), None)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""HTTP/1.1 on the wire for :mod:`handoff.service.upstream`: errors, request heads, one connection.

A :class:`Connection` is an asyncio Protocol that parses responses with
``httptools`` straight from ``data_received`` and carries one exchange at a
time. Its owner (the pool) hears of its end through ``on_closed``.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections import deque
from typing import Callable, Iterable, Mapping, Union

import httptools

Headers = Union[Mapping[str, str], Iterable[tuple[str, str]]]

_HIGH_WATER_BYTES = 256 * 1024
_LOW_WATER_BYTES = 64 * 1024


class UpstreamError(Exception):
    """A request to a peer failed; ``url`` names the request."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class ConnectFailed(UpstreamError):
    """The connection could not be made (refused, unreachable, unresolvable): the peer saw nothing."""


class ConnectTimedOut(ConnectFailed):
    """The connection was not made within the client's connect timeout (a partition, a dead host that
    drops packets): nothing was sent, so the peer saw nothing either."""


class UpstreamTimeout(UpstreamError):
    """The request's deadline passed before the response was complete."""


class ConnectionDropped(UpstreamError):
    """The peer closed or reset the connection before the response was complete."""


class ProtocolError(UpstreamError):
    """The peer answered something that is not valid HTTP/1.1."""


class ClientClosed(UpstreamError):
    """The client was closed; no request can start."""


class ConnState(enum.Enum):
    BUSY = "busy"      # one exchange in progress
    IDLE = "idle"      # in the pool, waiting for the next request
    CLOSED = "closed"  # transport closed; never used again


class Origin:
    """Where to connect, and the ``Host`` header that names it."""

    __slots__ = ("host", "port", "host_header")

    def __init__(self, host: str, port: int, host_header: str) -> None:
        self.host = host
        self.port = port
        self.host_header = host_header


@functools.lru_cache(maxsize=4096)
def parse_origin(authority: str) -> Origin:
    if not authority:
        raise ValueError("URL has no host")
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise ValueError(f"bad IPv6 address in {authority!r}")
        host, rest = authority[1:end], authority[end + 1:]
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = authority.partition(":")
    port = int(port_text) if port_text else 80
    if not 0 < port < 65536:
        raise ValueError(f"bad port in {authority!r}")
    return Origin(host, port, authority)


def split_url(url: str) -> tuple[Origin, str]:
    """``http://host:port/path?q`` -> (origin, ``/path?q``). Raises ``ValueError``."""
    if not url.startswith("http://"):
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    rest = url[7:]
    cut = len(rest)
    for sep in "/?":
        at = rest.find(sep)
        if 0 <= at < cut:
            cut = at
    target = rest[cut:] or "/"
    if target.startswith("?"):
        target = "/" + target
    return parse_origin(rest[:cut]), target


def encode_head(method: str, target: str, origin: Origin, headers: Headers | None, body_length: int) -> bytes:
    """The request line and headers; ``Content-Length`` unless a bodiless GET/DELETE/OPTIONS."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
    if headers:
        items = headers.items() if isinstance(headers, Mapping) else headers
        for name, value in items:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} contains a line break")
            lines.append(f"{name}: {value}\r\n")
    if body_length or method not in ("GET", "DELETE", "OPTIONS"):
        lines.append(f"Content-Length: {body_length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class Connection(asyncio.Protocol):
    """One TCP connection: the protocol callbacks, the parser callbacks, one exchange at a time."""

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop,
                 on_closed: Callable[[Connection], None]) -> None:
        self.origin = origin
        self.state = ConnState.BUSY
        self.is_reused = False
        self.idle_since = 0.0
        self.transport: asyncio.Transport | None = None
        self._loop = loop
        self._on_closed = on_closed
        self._parser = httptools.HttpResponseParser(self)
        self._url = ""
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
        self._is_body_until_close = False
        self._chunks: deque[bytes] = deque()
        self._num_buffered = 0
        self._is_reading_paused = False
        self._failure: UpstreamError | None = None

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
    def send(self, url: str, head: bytes, body: bytes, deadline: float | None) -> bool:
        """Write one request; False when the transport was already closed (nothing written)."""
        self._url = url
        if self.transport is None or self.transport.is_closing() or self.state is not ConnState.BUSY:
            return False
        if deadline is not None:
            self._timer = self._loop.call_at(deadline, self._on_deadline)
        if len(body) <= 65536:
            self.transport.write(head + body)
        else:
            self.transport.write(head)
            self.transport.write(body)
        return True

    # -- asyncio.Protocol --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.state is not ConnState.BUSY or self.is_message_done:
            # bytes nobody asked for: the connection cannot be trusted for another request
            self.close()
            return
        self.num_response_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"invalid HTTP response from {self.origin.host_header}: {exc}",
                                     url=self._url), exc)

    def eof_received(self) -> bool | None:
        if self.state is ConnState.BUSY and self._is_body_until_close and not self.is_message_done:
            self.is_keep_alive = False
            self._complete()
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is ConnState.BUSY and not self.is_message_done and self._failure is None:
            what = "before the response headers" if not self.is_headers_done else "in the response body"
            reason = f": {exc}" if exc else ""
            self._fail(ConnectionDropped(f"{self.origin.host_header} closed the connection {what}{reason}",
                                         url=self._url), exc)
        if self.state is not ConnState.CLOSED:
            self.state = ConnState.CLOSED
            self._cancel_timer()
            self._on_closed(self)

    # -- httptools callbacks -----------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.is_headers_done = True
        has_length = False
        for name, value in self.headers:
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
                has_length = True
                break
        self._is_body_until_close = not has_length and self.status >= 200 and self.status not in (204, 304)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._num_buffered += len(body)
        if self._num_buffered > _HIGH_WATER_BYTES and not self._is_reading_paused and self.transport:
            self._is_reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.is_keep_alive = self._parser.should_keep_alive()
        self._complete()

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

"""A small pooled HTTP/1.1 client for talking to nodes, over asyncio Protocols.

The LB (and the sidecar) spend most of their CPU relaying HTTP to peers on the
cluster network, so this client does only that, cheaply: responses are parsed
by :class:`~handoff.service.http1_parser.ResponseParser` (RFC 9112 framing,
h11's rules, bounded heads) straight from ``data_received``, with no stream
objects, no cookie jars and no per-request session.

::

    client = UpstreamClient()
    response = await client.request("POST", "http://10.0.0.7:8000/generate",
                                    headers={"Content-Type": "application/json"},
                                    body=b'{"text": "hi"}', timeout=30.0)
    async with response:
        async for chunk in response.aiter_bytes():
            ...
    await client.aclose()

A caller with many requests to make at once (a fan-out) writes them all first
with :meth:`UpstreamClient.start_many` (or :meth:`UpstreamClient.start` each)
and reads the answers as they come
(:class:`~handoff.service.upstream_pending.PendingRequest`): no task per
request.

Semantics:

- One pool of idle keep-alive connections per origin and no limit on open
  connections: a fan-out to 150 nodes opens 150 connections at once.
- ``timeout`` is one deadline for the whole exchange: connect, send, headers
  and every byte of the body. A peer that never answers, or sends headers and
  then stalls, costs at most ``timeout``.
- Interim 1xx responses are skipped (at most 16); the response is the final one.
  101 and statuses outside 100-599 are :class:`ProtocolError`, as are heads past
  ``max_head_bytes`` (64 KiB) or ``max_header_fields`` (100).
- Bodies are iterated as they arrive (chunked, Content-Length or read until
  close), as sent: a ``Content-Encoding`` is never decoded. Buffered reads
  always have a cap: :meth:`UpstreamResponse.read` keeps a prefix and sets
  ``is_truncated``, :meth:`UpstreamResponse.read_whole` raises
  :class:`ResponseTooLarge`. Trailers are checked and dropped.
- A response that was not read to its end, failed, or whose reader was
  cancelled closes its connection, and so do bytes past the end of a response
  (a second answer nobody asked for); only clean, complete exchanges go back to
  the pool.
- Stale keep-alive connections: an idle connection the peer closed is dropped
  from the pool as soon as the close is seen, and one idle past ``max_idle_s``
  is closed (within twice that) even if no request to its peer comes again
  (:meth:`UpstreamClient.close_idle` closes a peer's at once). If the peer
  closes a reused connection in the instant the request is sent, the request
  is retried once on a fresh connection only when the peer cannot have acted
  on it: nothing was written, or the method is idempotent and no byte of a
  response came back.
- Errors are :class:`UpstreamError` subclasses raised ``from`` the transport's
  own error, whatever the peer or the URL did. :class:`ConnectFailed` means the
  peer got nothing (refused, unreachable, name not resolved, a URL that names
  no valid host: :class:`InvalidURL`, or, with ``connect_timeout_s``, no
  connection within that time: :class:`ConnectTimedOut`), so the request may go
  to another peer. Without a connect timeout, a connection that never comes (a
  peer behind a partition drops the SYN) costs the whole deadline.

Only ``http://`` URLs.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Iterable, Mapping

from handoff.service.http1_parser import DEFAULT_MAX_FIELDS, DEFAULT_MAX_HEAD_BYTES
from handoff.service.http1_request import Headers, encode_head, split_url
from handoff.service.upstream_pending import PendingRequest
from handoff.service.upstream_pool import ConnectionPool
from handoff.service.upstream_response import UpstreamResponse
from handoff.service.upstream_errors import (
    ClientClosed,
    ConnectFailed,
    ConnectionDropped,
    ConnectTimedOut,
    InvalidHeader,
    InvalidURL,
    ProtocolError,
    ResponseTooLarge,
    TimedOutConnecting,
    UpstreamError,
    UpstreamTimeout,
)

__all__ = [
    "ClientClosed", "ConnectFailed", "ConnectTimedOut", "ConnectionDropped", "Headers", "InvalidHeader",
    "InvalidURL", "PendingRequest", "ProtocolError", "ResponseTooLarge", "TimedOutConnecting", "UpstreamClient",
    "UpstreamError", "UpstreamResponse", "UpstreamTimeout",
]

log = logging.getLogger(__name__)


# start_many writes its requests in bursts of this many: one wake of an idle peer's process per burst instead of per
# request, while the first peers get theirs before the last are prepared (all in one burst delayed every answer of
# peers that take a while: 2 ms later on 128 nodes answering in 20 ms)
WRITE_BURST = 16


def _write_all(held: list[tuple[asyncio.Transport, bytes]]) -> None:
    burst = held[:]
    held.clear()  # first: a write that raises leaves none of the burst to be written a second time
    for transport, data in burst:
        if not transport.is_closing():  # closed since (by this client): its reader hears of the drop
            transport.write(data)


def _close_all(started: list[PendingRequest | UpstreamError]) -> None:
    for request in started:
        if isinstance(request, PendingRequest):
            request.close()


class ClientState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class UpstreamClient:
    """Pooled HTTP/1.1 client; one per process, opened at start and closed with :meth:`aclose`.

    ``max_idle_s`` is how long an idle connection is reused: keep it below the
    peers' keep-alive timeout (uvicorn closes idle connections after 5 s by
    default) so the client almost never races a peer's close.
    ``connect_timeout_s`` bounds making a new connection (within the request's
    own deadline); past it the request fails with :class:`ConnectTimedOut`.
    ``None``: only the request's deadline bounds it.
    ``max_head_bytes`` and ``max_header_fields`` cap each response head (and the
    trailer section): past them the request fails with :class:`ProtocolError`.
    """

    def __init__(self, *, max_idle_per_origin: int = 256, max_idle_s: float = 4.0,
                 connect_timeout_s: float | None = None, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 max_header_fields: int = DEFAULT_MAX_FIELDS) -> None:
        if connect_timeout_s is not None and not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        if max_head_bytes < 1024 or max_header_fields < 1:
            raise ValueError(f"max_head_bytes must be >= 1024 and max_header_fields >= 1, "
                             f"got {max_head_bytes} and {max_header_fields}")
        self.state = ClientState.OPEN
        self._loop = asyncio.get_running_loop()
        self._pool = ConnectionPool(self._loop, self._write, max_idle_per_origin=max_idle_per_origin,
                                    max_idle_s=max_idle_s, connect_timeout_s=connect_timeout_s,
                                    max_head_bytes=max_head_bytes, max_header_fields=max_header_fields)
        self._held_writes: list[tuple[asyncio.Transport, bytes]] | None = None  # during start_many

    @property
    def num_connections(self) -> int:
        """Open connections, busy or idle."""
        return self._pool.num_connections

    @property
    def num_idle(self) -> int:
        return self._pool.num_idle

    async def request(self, method: str, url: str, *, headers: Headers | None = None, body: bytes = b"",
                      timeout: float | None = None) -> UpstreamResponse:
        """Send a request and return once the response headers arrived.

        ``timeout`` (seconds) bounds the whole exchange including the body read
        later. Raises an :class:`UpstreamError` subclass, whatever the peer or the
        URL does.
        """
        return await self._begin(method, url, headers, body, timeout, connect_now=False).response()

    def start(self, method: str, url: str, *, headers: Headers | None = None, body: bytes = b"",
              timeout: float | None = None, answer_caps: tuple[int, int] | None = None) -> PendingRequest:
        """Send a request now without waiting for its answer: written at once on an idle pooled connection,
        else as soon as a new one (connecting in the background) is up. Await
        :meth:`PendingRequest.response`, or :meth:`PendingRequest.close` it; ``timeout`` as for
        :meth:`request`; ``answer_caps``: the body bytes the caller will read of a 2xx answer and of any other
        (the request is answered once they are in). Raises :class:`UpstreamError` for a URL or header that
        cannot be sent."""
        return self._begin(method, url, headers, body, timeout, connect_now=True, answer_caps=answer_caps)

    def start_many(self, method: str, urls: Iterable[str], *, headers: Headers | None = None, body: bytes = b"",
                   timeout: float | None = None,
                   answer_caps: tuple[int, int] | None = None) -> list[PendingRequest | UpstreamError]:
        """:meth:`start` of one request to each of ``urls``, in order; a URL's request that cannot be sent is
        its :class:`UpstreamError`, in its place.

        The requests that go out on pooled connections are written back to back, :data:`WRITE_BURST` at a
        time, once those are prepared: each write between the preparation of the next request woke an idle
        peer process per request, and made the fan-out's writes and its answers' reads cost more
        (``docs/benchmarks.md``, load balancer, eighth pass).

        An exception other than :class:`UpstreamError` (one out of ``urls``) abandons every request started:
        the caller has none to read or close.
        """
        if headers is not None and not isinstance(headers, Mapping):
            headers = tuple(headers)  # every URL's request gets them, not only the first (an iterator is read once)
        held: list[tuple[asyncio.Transport, bytes]] = []
        self._held_writes = held
        started: list[PendingRequest | UpstreamError] = []
        try:
            for url in urls:
                try:
                    started.append(self._begin(method, url, headers, body, timeout, connect_now=True,
                                               answer_caps=answer_caps))
                except UpstreamError as exc:
                    started.append(exc)
                if len(held) >= WRITE_BURST:
                    _write_all(held)
            self._held_writes = None
            _write_all(held)
        except BaseException:
            # The caller gets no request to read or close (a URL iterator that raised): none stays in flight. What
            # is not on the wire stays off it; the requests of earlier bursts lose their connections.
            self._held_writes = None
            held.clear()
            _close_all(started)
            raise
        return started

    def _write(self, transport: asyncio.Transport, data: bytes) -> None:
        """How every connection of this client writes a request: now, or at the end of :meth:`start_many`."""
        held = self._held_writes
        if held is None:
            transport.write(data)
        else:
            held.append((transport, data))

    def _begin(self, method: str, url: str, headers: Headers | None, body: bytes, timeout: float | None, *,
               connect_now: bool, answer_caps: tuple[int, int] | None = None) -> PendingRequest:
        if self.state is not ClientState.OPEN:
            raise ClientClosed(f"client is {self.state.value}", url=url)
        origin, target = split_url(url)
        deadline = None if timeout is None else self._loop.time() + timeout
        try:
            head = encode_head(method, target, origin, headers, len(body))
        except InvalidHeader as exc:
            exc.url = url
            raise
        pool = self._pool
        return PendingRequest(method, url, origin, head, body, deadline, take_idle=pool.take_idle,
                              connect=pool.connect, release=pool.release, connect_now=connect_now,
                              answer_caps=answer_caps)

    def close_idle(self, url: str) -> None:
        """Close the idle pooled connections to ``url``'s origin (a peer this process is done with: a node that
        left); requests in flight to it finish as they would, their connections closed after ``max_idle_s`` idle."""
        try:
            origin, _ = split_url(url)
        except InvalidURL:
            return  # no connection was ever made to it
        self._pool.close_idle(origin.host_header)

    async def aclose(self) -> None:
        """Close every connection; requests in flight fail with :class:`ConnectionDropped`."""
        if self.state is ClientState.CLOSED:
            return
        self.state = ClientState.CLOSED
        self._pool.close()

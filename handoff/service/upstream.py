"""A small pooled HTTP/1.1 client for talking to nodes, over asyncio Protocols.

The LB (and the sidecar) spend most of their CPU relaying HTTP to peers on the
cluster network, so this client does only that, cheaply: responses are parsed
by ``httptools`` straight from ``data_received``, with no stream objects, no
cookie jars and no per-request session.

::

    client = UpstreamClient()
    response = await client.request("POST", "http://10.0.0.7:8000/generate",
                                    headers={"Content-Type": "application/json"},
                                    body=b'{"text": "hi"}', timeout=30.0)
    async with response:
        async for chunk in response.aiter_bytes():
            ...
    await client.aclose()

Semantics:

- One pool of idle keep-alive connections per origin and no limit on open
  connections: a fan-out to 150 nodes opens 150 connections at once.
- ``timeout`` is one deadline for the whole exchange: connect, send, headers
  and every byte of the body. A peer that never answers, or sends headers and
  then stalls, costs at most ``timeout``.
- Bodies are iterated as they arrive (chunked, Content-Length or read until
  close); :meth:`UpstreamResponse.read` can stop after ``max_bytes``.
- A response that was not read to its end, failed, or whose reader was
  cancelled closes its connection; only clean, complete exchanges go back to
  the pool.
- Stale keep-alive connections: an idle connection the peer closed is dropped
  from the pool as soon as the close is seen. If the peer closes a reused
  connection in the instant the request is sent, the request is retried once
  on a fresh connection only when the peer cannot have acted on it: nothing was
  written, or the method is idempotent and no byte of a response came back.
- Errors are :class:`UpstreamError` subclasses raised ``from`` the transport's
  own error. :class:`ConnectFailed` means the peer got nothing (refused,
  unreachable, name not resolved, or, with ``connect_timeout_s``, no connection
  within that time: :class:`ConnectTimedOut`), so the request may go to another
  peer. Without a connect timeout, a connection that never comes (a peer behind
  a partition drops the SYN) costs the whole deadline.

Only ``http://`` URLs; ``HEAD`` is not supported (its response has no body and
the parser cannot tell).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from typing import AsyncIterator, Callable

from handoff.service.http1 import (
    ClientClosed,
    ConnectFailed,
    ConnectTimedOut,
    Connection,
    ConnectionDropped,
    ConnState,
    Headers,
    Origin,
    ProtocolError,
    UpstreamError,
    UpstreamTimeout,
    encode_head,
    split_url,
)

__all__ = [
    "ClientClosed", "ConnectFailed", "ConnectTimedOut", "ConnectionDropped", "Headers", "ProtocolError", "UpstreamClient",
    "UpstreamError", "UpstreamResponse", "UpstreamTimeout",
]

log = logging.getLogger(__name__)

IDEMPOTENT_METHODS = frozenset({"GET", "PUT", "DELETE", "OPTIONS"})


class UpstreamResponse:
    """A response whose headers have arrived; the body is read on demand.

    Use it as an async context manager, or call :meth:`aclose`: a body left
    unread closes the connection instead of returning it to the pool.
    """

    __slots__ = ("url", "status", "headers", "is_truncated", "_conn", "_release", "_is_done")

    def __init__(self, url: str, conn: Connection, release: Callable[[Connection], None]) -> None:
        self.url = url
        self.status = conn.status
        self.headers = conn.headers
        self.is_truncated = False
        self._conn = conn
        self._release = release
        self._is_done = False

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), decoded as latin-1."""
        key = name.lower().encode("latin-1")
        for header_name, value in self.headers:
            if header_name == key:
                return value.decode("latin-1")
        return None

    @property
    def content_type(self) -> str:
        return self.header("content-type") or ""

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the end.

        At the end the connection goes back to the pool.
        """
        if self._is_done:
            return b""
        try:
            chunk = await self._conn.receive_chunk()
        except BaseException:
            self.close()
            raise
        if not chunk:
            self._is_done = True
            self._release(self._conn)
        return chunk

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Iterate the body as it arrives (each item: whatever arrived since the previous one)."""
        return _BodyIterator(self)

    async def read(self, max_bytes: int | None = None) -> bytes:
        """Read the body; with ``max_bytes``, stop there (``is_truncated`` tells) and close the connection."""
        parts: list[bytes] = []
        num_read = 0
        while True:
            chunk = await self.next_chunk()
            if not chunk:
                return b"".join(parts)
            if max_bytes is not None and num_read + len(chunk) >= max_bytes:
                parts.append(chunk[:max_bytes - num_read])
                self._stop_at_cap(overflow=num_read + len(chunk) > max_bytes)
                return b"".join(parts)
            parts.append(chunk)
            num_read += len(chunk)

    def _stop_at_cap(self, *, overflow: bool) -> None:
        conn = self._conn
        if not overflow and conn.is_drained:
            self._is_done = True
            self._release(conn)
            return
        self.is_truncated = True
        self.close()

    def close(self) -> None:
        """Abandon the response: unless it was read to the end, its connection is closed."""
        if not self._is_done:
            self._is_done = True
            self._conn.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class _BodyIterator:
    __slots__ = ("_response",)

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> _BodyIterator:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.next_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk


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
    """

    def __init__(self, *, max_idle_per_origin: int = 256, max_idle_s: float = 4.0,
                 connect_timeout_s: float | None = None) -> None:
        if connect_timeout_s is not None and not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        self.max_idle_per_origin = max_idle_per_origin
        self.max_idle_s = max_idle_s
        self.connect_timeout_s = connect_timeout_s
        self.state = ClientState.OPEN
        self._loop = asyncio.get_running_loop()
        self._idle: dict[str, deque[Connection]] = {}
        self._conns: set[Connection] = set()

    @property
    def num_connections(self) -> int:
        """Open connections, busy or idle."""
        return len(self._conns)

    @property
    def num_idle(self) -> int:
        return sum(len(pool) for pool in self._idle.values())

    async def request(self, method: str, url: str, *, headers: Headers | None = None, body: bytes = b"",
                      timeout: float | None = None) -> UpstreamResponse:
        """Send a request and return once the response headers arrived.

        ``timeout`` (seconds) bounds the whole exchange including the body read
        later. Raises an :class:`UpstreamError` subclass.
        """
        if self.state is not ClientState.OPEN:
            raise ClientClosed(f"client is {self.state.value}", url=url)
        if method == "HEAD":
            raise ValueError("HEAD is not supported")
        origin, target = split_url(url)
        deadline = None if timeout is None else self._loop.time() + timeout
        head = encode_head(method, target, origin, headers, len(body))
        is_retry = False
        while True:
            conn = await self._acquire(origin, url, deadline, force_new=is_retry)
            is_written = False
            try:
                is_written = conn.send(url, head, body, deadline)
                if not is_written:
                    raise ConnectionDropped(f"{origin.host_header} closed the connection before the request",
                                            url=url)
                await conn.receive_headers()
            except ConnectionDropped:
                conn.close()
                could_not_have_acted = not is_written or (conn.num_response_bytes == 0
                                                          and method in IDEMPOTENT_METHODS)
                if not is_retry and conn.is_reused and could_not_have_acted:
                    log.debug("retrying %s %s on a fresh connection (stale keep-alive)", method, url)
                    is_retry = True
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            return UpstreamResponse(url, conn, self._release)

    async def _acquire(self, origin: Origin, url: str, deadline: float | None, *,
                       force_new: bool) -> Connection:
        pool = self._idle.get(origin.host_header)
        if pool and not force_new:
            now = self._loop.time()
            while pool:
                conn = pool.pop()
                if conn.is_fresh_enough(now, self.max_idle_s):
                    conn.mark_busy()
                    return conn
                conn.close()
        return await self._connect(origin, url, deadline)

    async def _connect(self, origin: Origin, url: str, deadline: float | None) -> Connection:
        connect = self._loop.create_connection(lambda: Connection(origin, self._loop, self._forget),
                                               origin.host, origin.port)
        now = self._loop.time()
        connect_deadline = deadline
        is_connect_timeout_first = False
        if self.connect_timeout_s is not None and (deadline is None or now + self.connect_timeout_s < deadline):
            connect_deadline = now + self.connect_timeout_s
            is_connect_timeout_first = True
        try:
            if connect_deadline is None:
                _, conn = await connect
            else:
                _, conn = await asyncio.wait_for(connect, max(0.0, connect_deadline - now))
        except asyncio.TimeoutError as exc:
            if is_connect_timeout_first:
                raise ConnectTimedOut(f"cannot connect to {origin.host_header}: no connection within "
                                      f"{self.connect_timeout_s:g} s", url=url) from exc
            raise UpstreamTimeout(f"connecting to {origin.host_header} timed out", url=url) from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin.host_header}: {exc.strerror or exc}",
                                url=url) from exc
        if self.state is not ClientState.OPEN:
            conn.close()
            raise ClientClosed(f"client is {self.state.value}", url=url)
        self._conns.add(conn)
        return conn

    def _release(self, conn: Connection) -> None:
        """Return a connection whose exchange completed cleanly to its pool (or close it)."""
        if (self.state is not ClientState.OPEN or conn.state is not ConnState.BUSY or not conn.is_keep_alive
                or conn.transport is None or conn.transport.is_closing()):
            conn.close()
            return
        pool = self._idle.setdefault(conn.origin.host_header, deque())
        if len(pool) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.mark_idle()
        pool.append(conn)

    def _forget(self, conn: Connection) -> None:
        self._conns.discard(conn)
        pool = self._idle.get(conn.origin.host_header)
        if pool and conn in pool:
            pool.remove(conn)

    async def aclose(self) -> None:
        """Close every connection; requests in flight fail with :class:`ConnectionDropped`."""
        if self.state is ClientState.CLOSED:
            return
        self.state = ClientState.CLOSED
        for conn in list(self._conns):
            conn.close()
        self._idle.clear()

"""The connections of :class:`~handoff.service.upstream.UpstreamClient`: made (bounded by the connect timeout and
the request's deadline), pooled idle per origin while fresh enough, and closed with the client.

One pool of idle keep-alive connections per origin and no limit on open connections; only a connection whose
exchange completed cleanly goes back to its pool. An idle connection is closed once it has idled ``max_idle_s`` (at
the latest twice that), whether or not a request to its origin comes to find it stale: a peer that never closes an
idle connection itself (one that died without a FIN, a node that left the membership) holds no socket for good.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from handoff.service.http1 import Connection, ConnState
from handoff.service.http1_request import Origin
from handoff.service.upstream_errors import ClientClosed, ConnectFailed, ConnectTimedOut, InvalidURL, TimedOutConnecting

Write = Callable[[asyncio.Transport, bytes], None]


class ConnectionPool:
    """Every open connection of one client, and the idle ones by origin (see ``UpstreamClient`` for the knobs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, write: Write, *, max_idle_per_origin: int,
                 max_idle_s: float, connect_timeout_s: float | None, max_head_bytes: int,
                 max_header_fields: int) -> None:
        self.max_idle_per_origin = max_idle_per_origin
        self.max_idle_s = max_idle_s
        self.connect_timeout_s = connect_timeout_s
        self.max_head_bytes = max_head_bytes
        self.max_header_fields = max_header_fields
        self.is_closed = False
        self._loop = loop
        self._write = write
        self._idle: dict[str, deque[Connection]] = {}  # oldest first
        self._conns: set[Connection] = set()
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def num_connections(self) -> int:
        """Open connections, busy or idle."""
        return len(self._conns)

    @property
    def num_idle(self) -> int:
        return sum(len(pool) for pool in self._idle.values())

    def take_idle(self, origin: Origin) -> Connection | None:
        """A pooled connection to ``origin`` still fit for use, marked busy; None when there is none."""
        pool = self._idle.get(origin.host_header)
        if pool:
            now = self._loop.time()
            while pool:
                conn = pool.pop()
                if conn.is_fresh_enough(now, self.max_idle_s):
                    conn.mark_busy()
                    return conn
                conn.close()
        return None

    async def connect(self, origin: Origin, url: str, deadline: float | None) -> Connection:
        """A new connection to ``origin``, by ``deadline`` and the connect timeout; :class:`ConnectFailed` (or one
        of its kinds) when there is none, :class:`ClientClosed` when the client closed meanwhile."""
        connect = self._loop.create_connection(self._new_connection(origin), origin.host, origin.port)
        now = self._loop.time()
        connect_deadline = deadline
        is_connect_timeout_first = False
        if self.connect_timeout_s is not None and (deadline is None or now + self.connect_timeout_s < deadline):
            connect_deadline = now + self.connect_timeout_s
            is_connect_timeout_first = True
        try:
            # asyncio.timeout_at, not wait_for: Python 3.11's wait_for returns a connection that came up in the turn
            # its caller was cancelled and drops the cancel (the request went out and waited for its own deadline)
            async with asyncio.timeout_at(connect_deadline):
                _, conn = await connect
        except TimeoutError as exc:
            if is_connect_timeout_first:
                raise ConnectTimedOut(f"cannot connect to {origin.host_header}: no connection within "
                                      f"{self.connect_timeout_s:g} s", url=url) from exc
            raise TimedOutConnecting(f"connecting to {origin.host_header} timed out", url=url) from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin.host_header}: {exc.strerror or exc}",
                                url=url) from exc
        except (ValueError, OverflowError) as exc:  # what the resolver or socket layer refuses to look up
            raise InvalidURL(f"cannot connect to {origin.host_header}: {exc}", url=url) from exc
        if self.is_closed:
            conn.close()
            raise ClientClosed("client is closed", url=url)
        self._conns.add(conn)
        return conn

    def _new_connection(self, origin: Origin) -> Callable[[], Connection]:
        return lambda: Connection(origin, self._loop, self._forget, max_head_bytes=self.max_head_bytes,
                                  max_fields=self.max_header_fields, write=self._write)

    def release(self, conn: Connection) -> None:
        """Return a connection whose exchange completed cleanly to its pool (or close it)."""
        if (self.is_closed or conn.state is not ConnState.BUSY or not conn.is_keep_alive
                or conn.transport is None or conn.transport.is_closing()):
            conn.close()
            return
        pool = self._idle.setdefault(conn.origin.host_header, deque())
        if len(pool) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.mark_idle()
        pool.append(conn)
        if self._sweep is None:
            self._sweep = self._loop.call_later(self.max_idle_s, self._close_stale)

    def _close_stale(self) -> None:
        """Close the connections idle past ``max_idle_s``; again in ``max_idle_s`` while any stays idle."""
        self._sweep = None
        now = self._loop.time()
        for key, pool in list(self._idle.items()):
            while pool and not pool[0].is_fresh_enough(now, self.max_idle_s):
                pool.popleft().close()
            if not pool:
                del self._idle[key]
        if self._idle and not self.is_closed:
            self._sweep = self._loop.call_later(self.max_idle_s, self._close_stale)

    def close_idle(self, host_header: str) -> None:
        """Close every idle connection to the origin named ``host_header`` (a peer this process is done with)."""
        for conn in self._idle.pop(host_header, ()):
            conn.close()

    def _forget(self, conn: Connection) -> None:
        self._conns.discard(conn)
        pool = self._idle.get(conn.origin.host_header)
        if pool and conn in pool:
            pool.remove(conn)

    def close(self) -> None:
        """Close every connection (requests in flight fail with ``ConnectionDropped``); none is made or pooled
        after."""
        self.is_closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._conns):
            conn.close()
        self._idle.clear()

"""A response of :class:`~handoff.service.upstream.UpstreamClient`: headers in, the body read on demand."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from handoff.service.http1 import Connection
from handoff.service.upstream_errors import ResponseTooLarge


class UpstreamResponse:
    """A response whose headers have arrived; the body is read on demand.

    Use it as an async context manager, or call :meth:`aclose`: a body left
    unread closes the connection instead of returning it to the pool.
    """

    __slots__ = ("url", "status", "headers", "is_truncated", "_conn", "_release", "_is_done", "_head", "_deadline")

    def __init__(self, url: str, conn: Connection, release: Callable[[Connection], None]) -> None:
        self.url = url
        self.status = conn.status
        self.headers = conn.headers
        self.is_truncated = False
        self._conn = conn
        self._release = release
        self._is_done = False
        self._head = b""  # body bytes put back by :meth:`unread`, returned first
        # this exchange's: the connection, back in the pool with the body's last byte, may take another's
        self._deadline = conn.deadline

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), decoded as latin-1."""
        key = name.lower().encode("latin-1")
        for header_name, value in self.headers:
            if header_name == key:
                return value.decode("latin-1")
        return None

    @property
    def deadline(self) -> float | None:
        """When the exchange must be over (the loop's clock), or None when no timeout bounds it."""
        return self._deadline

    @property
    def content_type(self) -> str:
        return self.header("content-type") or ""

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the end.

        At the end the connection goes back to the pool.
        """
        if self._head:
            chunk, self._head = self._head, b""
            return chunk
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

    def unread(self, data: bytes) -> None:
        """Put back ``data``, the body bytes read last (a peek at a stream's start): the next read returns them
        first. A response closed or cut meanwhile drops them."""
        self._head = data + self._head

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Iterate the body as it arrives (each item: whatever arrived since the previous one)."""
        return _BodyIterator(self)

    async def read(self, max_bytes: int, *, count: Callable[[int], None] | None = None) -> bytes:
        """The body, or its first ``max_bytes`` when longer: then ``is_truncated`` is set and the
        connection closed. For answers a prefix of is still useful (an error's detail, a log excerpt).
        ``count`` is told each piece's size before it is kept (what it raises ends the read)."""
        parts: list[bytes] = []
        num_read = 0
        while True:
            chunk = await self.next_chunk()
            if not chunk:
                return b"".join(parts)
            if count is not None:
                count(min(len(chunk), max_bytes - num_read))
            if num_read + len(chunk) >= max_bytes:
                parts.append(chunk[:max_bytes - num_read])
                overflow = num_read + len(chunk) > max_bytes
                if not overflow and not self._conn.is_drained:
                    # exactly the cap so far: the body's end (a chunked body's last chunk may come later) or more
                    if not await self.next_chunk():
                        return b"".join(parts)
                    overflow = True
                self._stop_at_cap(overflow=overflow)
                return b"".join(parts)
            parts.append(chunk)
            num_read += len(chunk)
            if self._conn.is_drained and not self._head:  # that was the last piece: the end needs no further call
                if not self._is_done:  # (a peek put back may have come after the end)
                    self._is_done = True
                    self._release(self._conn)
                return b"".join(parts)

    async def read_whole(self, max_bytes: int, *, count: Callable[[int], None] | None = None) -> bytes:
        """The whole body; past ``max_bytes`` raises :class:`ResponseTooLarge` (connection closed).

        For answers that are relayed or judged whole: a caller answers 502 instead of a cut body.
        """
        body = await self.read(max_bytes, count=count)
        if self.is_truncated:
            raise ResponseTooLarge(f"the answer is longer than {max_bytes} bytes", url=self.url,
                                   max_bytes=max_bytes)
        return body

    def _stop_at_cap(self, *, overflow: bool) -> None:
        conn = self._conn
        if not overflow and conn.is_drained and not self._head:
            if not self._is_done:
                self._is_done = True
                self._release(conn)
            return
        self.is_truncated = True
        self.close()

    def close(self) -> None:
        """Abandon the response: unless it was read to the end, its connection is closed."""
        self._head = b""
        if not self._is_done:
            self._is_done = True
            self._conn.close()

    def cut(self) -> None:
        """Close the connection for whoever reads this response in another task: a read waiting, or the next
        one, fails with :class:`~handoff.service.upstream_errors.ConnectionDropped` (after :meth:`close` the
        next read would be the body's end: a cut stream taken for a complete one). A body already read to its
        end is left as it is."""
        if not self._is_done:
            self._head = b""
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

"""Fake peers for the upstream client: loopback TCP servers that answer with scripted bytes."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

CAP = 1 << 20  # bytes: every buffered read in these tests has a cap

Handler = Callable[["Conn"], Awaitable[None]]


class Conn:
    """One accepted connection of a :class:`ScriptedServer`, read request by request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read_request(self) -> tuple[str, dict[str, str], bytes] | None:
        """(request line, headers, body) or None at EOF."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return lines[0], headers, body

    async def respond(self, status: int = 200, body: bytes = b"ok", extra: str = "") -> None:
        self.writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)
        await self.writer.drain()


class ScriptedServer:
    """A loopback TCP server running ``handler`` for each connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.num_connections = 0
        self.closed_by_peer = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0, backlog=1024)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            await self.handler(Conn(reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer.set()
        finally:
            writer.close()


async def never_answer(conn: Conn) -> None:
    """A :class:`ScriptedServer` handler that reads and never answers (ends when the client goes)."""
    await conn.reader.read()


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; fails after ``timeout_s``."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


def answers(*scripts: bytes | list[bytes]) -> Handler:
    """A handler answering the n-th request of a connection with ``scripts[n]``, raw (a list: its pieces
    written one by one); after the last it waits until the client closes."""
    async def handler(conn: Conn) -> None:
        for script in scripts:
            if await conn.read_request() is None:
                return
            for piece in [script] if isinstance(script, bytes) else script:
                conn.writer.write(piece)
                await conn.writer.drain()
        await conn.reader.read()

    return handler

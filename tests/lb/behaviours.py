"""What fake nodes do on demand: answer slowly, hang, stall, drop, stream, or refuse connections."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Iterable

from tests.lb.fakes import Exchange, FakeCluster, FakeNode, Handler


def refused_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def reply(status: int, body: bytes | Any = b"", *, delay: float = 0.0,
          content_type: str = "application/json") -> Handler:
    async def handler(node: FakeNode, ex: Exchange) -> None:
        if delay:
            await asyncio.sleep(delay)  # the node's own latency
        ex.respond(status, body, content_type=content_type)
    return handler


def hang() -> Handler:
    async def handler(node: FakeNode, ex: Exchange) -> None:
        await ex.wait_closed()
    return handler


def stall_after_headers(status: int = 200) -> Handler:
    async def handler(node: FakeNode, ex: Exchange) -> None:
        ex.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                 '{"success": tr'.encode())
        await ex.wait_closed()
    return handler


def drop() -> Handler:
    async def handler(node: FakeNode, ex: Exchange) -> None:
        ex.abort()
    return handler


def endless(status: int = 500) -> Handler:
    async def handler(node: FakeNode, ex: Exchange) -> None:
        ex.start_chunked(status, "text/plain")
        while not ex.is_closed:
            ex.chunk(b"x" * 65536)
            while ex.conn.transport.get_write_buffer_size() > (1 << 20) and not ex.is_closed:
                await asyncio.sleep(0.005)  # the node's own pacing: wait for the reader
            await asyncio.sleep(0)
    return handler


class Gate:
    """An event the test thread opens and fake nodes await on their loop."""

    def __init__(self, cluster: FakeCluster) -> None:
        self._loop = cluster.loop
        self._event = asyncio.Event()

    def open(self) -> None:
        self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self) -> None:
        await self._event.wait()


def sse(pieces: Iterable[bytes], *, gate: Gate | None = None, status: int = 200) -> Handler:
    """Send ``pieces`` as separate chunks; with ``gate``, hold the rest after the first piece."""
    pieces = list(pieces)

    async def handler(node: FakeNode, ex: Exchange) -> None:
        ex.start_chunked(status)
        for i, piece in enumerate(pieces):
            ex.chunk(piece)
            if i == 0 and gate is not None:
                await gate.wait()
            await asyncio.sleep(0)
        ex.end_chunked()
    return handler

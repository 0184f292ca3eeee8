"""Connection lifetime: a cancel as the connection comes up, stale keep-alives, half-closes, a body at its cap."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from handoff.service.upstream import ConnectionDropped, ResponseTooLarge, UpstreamClient
from tests.service.peers import CAP, Conn, ScriptedServer, never_answer, until

pytestmark = pytest.mark.timeout(30)


class _CancelAtConnect:
    """The pool's loop, but the caller's task is cancelled in the very turn its new connection comes up (by a
    callback of that turn, as a client's disconnect or an ``asyncio.timeout`` would)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.task: asyncio.Task[Any] | None = None

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        made = await self._loop.create_connection(*args, **kwargs)
        assert self.task is not None
        self._loop.call_soon(self.task.cancel)
        return made

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


async def test_a_cancel_as_the_connection_comes_up_is_not_lost(client: UpstreamClient) -> None:
    """The caller is cancelled (its own timeout, its client gone) in the turn the connect completes: the request
    ends in CancelledError and closes its connection (Python 3.11's wait_for dropped the cancel: the request went
    out and waited for the answer until its own deadline)."""
    async with ScriptedServer(never_answer) as server:
        patched = _CancelAtConnect(asyncio.get_running_loop())
        client._pool._loop = patched  # type: ignore[assignment]
        task = asyncio.create_task(client.request("POST", server.url + "/generate", body=b"{}", timeout=3))
        patched.task = task
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5)
        assert task.cancelled()
        await until(lambda: client.num_connections == 0)


async def test_head_on_a_stale_keep_alive_is_retried(client: UpstreamClient) -> None:
    """HEAD is as safe as GET (RFC 9110 9.2.2): a reused connection the peer closed without a byte is retried."""
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        await conn.writer.drain()
        await conn.read_request()  # and close without a byte

    async with ScriptedServer(handler) as server:
        await (await client.request("HEAD", server.url, timeout=5)).read_whole(CAP)
        assert client.num_idle == 1
        response = await client.request("HEAD", server.url, timeout=5)
        assert response.status == 200 and await response.read_whole(CAP) == b""
        assert server.num_connections == 2


@pytest.mark.parametrize("body_bytes", [2, 8 << 20], ids=["small-body", "body-still-unsent"])
async def test_a_peer_that_half_closes_before_answering_is_a_drop_at_once(client: UpstreamClient,
                                                                          body_bytes: int) -> None:
    """The peer reads the request head, shuts down its sending side and reads no more: no answer can come. The
    request fails with ConnectionDropped then, not UpstreamTimeout at its deadline (a close waited for a request
    body the peer never reads; without a timeout, forever)."""
    finished = asyncio.Event()

    async def handler(conn: Conn) -> None:
        await conn.reader.readuntil(b"\r\n\r\n")
        conn.writer.write_eof()
        conn.writer.transport.pause_reading()  # the rest of the body stays unread
        await finished.wait()

    async with ScriptedServer(handler) as server:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            with pytest.raises(ConnectionDropped, match="before the response headers"):
                await client.request("POST", server.url + "/generate", body=b"x" * body_bytes, timeout=10)
            assert loop.time() - started < 5
            await until(lambda: client.num_connections == 0)
        finally:
            finished.set()


async def test_a_chunked_body_of_exactly_the_cap_is_whole(client: UpstreamClient) -> None:
    """A chunked body of exactly ``max_bytes`` whose last chunk comes in a later segment (a streaming server
    writes it when the body ends) is the whole body, not one "longer than" the cap: it was ResponseTooLarge (a
    502) and its connection closed."""
    size = 1000
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % size + b"a" * size + b"\r\n"

    async def handler(conn: Conn) -> None:
        while await conn.read_request() is not None:
            conn.writer.write(head)
            await conn.writer.drain()
            await asyncio.sleep(0.05)  # the last chunk in a segment of its own
            conn.writer.write(b"0\r\n\r\n")
            await conn.writer.drain()

    async with ScriptedServer(handler) as server:
        assert await (await client.request("GET", server.url, timeout=5)).read_whole(size) == b"a" * size
        response = await client.request("GET", server.url, timeout=5)
        assert await response.read(size) == b"a" * size and not response.is_truncated
        assert server.num_connections == 1 and client.num_idle == 1
        with pytest.raises(ResponseTooLarge):  # one byte less is past the cap, whenever the end comes
            await (await client.request("GET", server.url, timeout=5)).read_whole(size - 1)


async def test_idle_connections_close_past_max_idle_without_another_request() -> None:
    """An idle connection is closed once it idled ``max_idle_s`` though no request to its peer comes to find it
    stale (a node that left, a peer that never closes): it stayed open for good (review C). ``close_idle`` closes
    one peer's idle connections at once and leaves the others."""
    open_conns: set[Conn] = set()

    async def keep_open(conn: Conn) -> None:
        open_conns.add(conn)
        while await conn.read_request() is not None:
            await conn.respond(200, b"ok")
        open_conns.discard(conn)

    client = UpstreamClient(max_idle_s=0.3)
    async with ScriptedServer(keep_open) as server, ScriptedServer(keep_open) as other:
        for url in (server.url, other.url):
            await (await client.request("GET", url + "/x", timeout=5)).read_whole(CAP)
        assert client.num_idle == 2 and len(open_conns) == 2
        client.close_idle(server.url)
        assert client.num_idle == 1
        await until(lambda: len(open_conns) == 1)
        await until(lambda: client.num_connections == 0 and not open_conns, timeout_s=3)
        await (await client.request("GET", other.url + "/x", timeout=5)).read_whole(CAP)  # a fresh one, pooled
        assert client.num_idle == 1
    await client.aclose()

"""The pooled upstream client against real loopback servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import socket

import pytest

from handoff.service.upstream import (
    ClientClosed,
    ConnectFailed,
    ConnectionDropped,
    InvalidHeader,
    InvalidURL,
    ProtocolError,
    UpstreamClient,
    UpstreamTimeout,
)
from tests.service.peers import CAP, Conn, ScriptedServer, until

pytestmark = pytest.mark.timeout(20)

async def serve_ok(conn: Conn) -> None:
    while (request := await conn.read_request()) is not None:
        line, headers, body = request
        await conn.respond(200, f"{line}|{headers.get('x-tag', '')}|".encode() + body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_get_and_post_reuse_one_keepalive_connection(client: UpstreamClient) -> None:
    async with ScriptedServer(serve_ok) as server:
        r1 = await client.request("GET", server.url + "/a?x=1", headers={"X-Tag": "t"}, timeout=5)
        assert r1.status == 200 and await r1.read_whole(CAP) == b"GET /a?x=1 HTTP/1.1|t|"
        r2 = await client.request("POST", server.url + "/b", body=b"\x00\xffpayload", timeout=5)
        assert await r2.read_whole(CAP) == b"POST /b HTTP/1.1||\x00\xffpayload"
        r3 = await client.request("POST", server.url + "/empty", timeout=5)
        assert await r3.read_whole(CAP) == b"POST /empty HTTP/1.1||"
        assert server.num_connections == 1
        assert client.num_idle == 1


async def test_chunked_body_is_streamed_as_it_arrives(client: UpstreamClient) -> None:
    release_second = asyncio.Event()

    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await conn.writer.drain()
        await release_second.wait()
        conn.writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await conn.writer.drain()
        await conn.read_request()

    async with ScriptedServer(handler) as server:
        response = await client.request("GET", server.url + "/s", timeout=5)
        chunks = response.aiter_bytes()
        assert await chunks.__anext__() == b"first"  # arrives before the server sends the rest
        release_second.set()
        assert [c async for c in chunks] == [b"second"]
        assert client.num_idle == 1


async def test_body_read_until_close(client: UpstreamClient) -> None:
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await conn.writer.drain()

    async with ScriptedServer(handler) as server:
        response = await client.request("GET", server.url, timeout=5)
        assert await response.read_whole(CAP) == b"until the end"
        assert client.num_connections == 0


async def test_no_content_statuses_have_no_body(client: UpstreamClient) -> None:
    async def handler(conn: Conn) -> None:
        while await conn.read_request() is not None:
            conn.writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")

    async with ScriptedServer(handler) as server:
        for _ in range(2):
            response = await client.request("DELETE", server.url + "/x", timeout=5)
            assert response.status == 204 and await response.read_whole(CAP) == b""
        assert server.num_connections == 1


@pytest.mark.parametrize("endless", [False, True])
async def test_capped_read_stops_and_closes_the_connection(client: UpstreamClient, endless: bool) -> None:
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        if endless:
            conn.writer.write(b"HTTP/1.1 500 X\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                conn.writer.write(b"4000\r\n" + b"e" * 0x4000 + b"\r\n")
                await conn.writer.drain()
        else:
            await conn.respond(500, b"x" * (1 << 20))
            await conn.reader.read()

    async with ScriptedServer(handler) as server:
        response = await client.request("POST", server.url, timeout=5)
        body = await response.read(max_bytes=512)
        assert len(body) == 512 and response.is_truncated
        assert client.num_connections == 0
        if endless:
            await asyncio.wait_for(server.closed_by_peer.wait(), 5)


async def test_capped_read_of_a_short_body_keeps_the_connection(client: UpstreamClient) -> None:
    async with ScriptedServer(serve_ok) as server:
        response = await client.request("GET", server.url + "/", timeout=5)
        body = await response.read(max_bytes=512)
        assert body.startswith(b"GET / ") and not response.is_truncated
        assert client.num_idle == 1


async def test_refused_connection_is_connect_failed(client: UpstreamClient) -> None:
    url = f"http://127.0.0.1:{free_port()}/x"
    with pytest.raises(ConnectFailed) as info:
        await client.request("POST", url, timeout=5)
    assert isinstance(info.value.__cause__, OSError) and info.value.url == url


async def test_hung_peer_costs_the_deadline(client: UpstreamClient) -> None:
    async def handler(conn: Conn) -> None:
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout):
            await client.request("GET", server.url, timeout=0.3)
        assert asyncio.get_running_loop().time() - started < 5  # 0.3 s; a hung peer without it: forever
        assert client.num_connections == 0


async def test_headers_then_stall_times_out_on_the_body(client: UpstreamClient) -> None:
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        loop = asyncio.get_running_loop()
        started = loop.time()
        response = await client.request("GET", server.url, timeout=0.4)
        with pytest.raises(UpstreamTimeout):
            await response.read_whole(CAP)
        assert 0.3 < loop.time() - started < 5


@pytest.mark.parametrize("when", ["before headers", "in body"])
async def test_dropped_connection(client: UpstreamClient, when: str) -> None:
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        if when == "in body":
            conn.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            await conn.writer.drain()
        conn.writer.transport.abort()

    async with ScriptedServer(handler) as server:
        with pytest.raises(ConnectionDropped):
            response = await client.request("POST", server.url, timeout=5)
            await response.read_whole(CAP)


async def test_garbage_is_a_protocol_error(client: UpstreamClient) -> None:
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        with pytest.raises(ProtocolError) as info:
            await client.request("GET", server.url, timeout=5)
        assert info.value.__cause__ is not None


async def test_cancelled_request_closes_its_connection(client: UpstreamClient) -> None:
    got_request = asyncio.Event()

    async def handler(conn: Conn) -> None:
        await conn.read_request()
        got_request.set()
        await conn.reader.read()
        raise ConnectionResetError("peer went away")

    async with ScriptedServer(handler) as server:
        task = asyncio.create_task(client.request("GET", server.url, timeout=10))
        await asyncio.wait_for(got_request.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)
        assert client.num_connections == 0


async def test_unread_body_closes_instead_of_pooling(client: UpstreamClient) -> None:
    async with ScriptedServer(serve_ok) as server:
        async with await client.request("GET", server.url, timeout=5):
            pass
        assert client.num_connections == 0
        await (await client.request("GET", server.url, timeout=5)).read_whole(CAP)
        assert server.num_connections == 2


async def test_idle_connection_closed_by_peer_is_not_reused(client: UpstreamClient) -> None:
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        await conn.respond(200, b"once")  # keep-alive promised, then closed while idle

    async with ScriptedServer(handler) as server:
        assert await (await client.request("POST", server.url, timeout=5)).read_whole(CAP) == b"once"
        await until(lambda: client.num_connections == 0)
        assert await (await client.request("POST", server.url, timeout=5)).read_whole(CAP) == b"once"
        assert server.num_connections == 2


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_peer_closing_a_reused_connection_at_send(client: UpstreamClient, method: str) -> None:
    """The peer reads the second request and closes without a byte: GET is retried, POST is not."""
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        await conn.respond(200, b"first")
        await conn.read_request()

    async with ScriptedServer(handler) as server:
        await (await client.request(method, server.url, timeout=5)).read_whole(CAP)
        if method == "GET":
            assert await (await client.request(method, server.url, timeout=5)).read_whole(CAP) == b"first"
            assert server.num_connections == 2
        else:
            with pytest.raises(ConnectionDropped):
                await client.request(method, server.url, timeout=5)
            assert server.num_connections == 1


async def test_no_connection_limit(client: UpstreamClient) -> None:
    """150 requests held by the server until all 150 arrived: a pool limit would deadlock."""
    num_requests = 150
    arrived = 0
    all_arrived = asyncio.Event()

    async def handler(conn: Conn) -> None:
        nonlocal arrived
        await conn.read_request()
        arrived += 1
        if arrived == num_requests:
            all_arrived.set()
        await all_arrived.wait()
        await conn.respond(200, b"go")
        await conn.read_request()

    async with ScriptedServer(handler) as server:
        async def one() -> bytes:
            return await (await client.request("GET", server.url, timeout=10)).read_whole(CAP)

        bodies = await asyncio.gather(*(one() for _ in range(num_requests)))
        assert bodies == [b"go"] * num_requests


async def test_aclose_closes_everything_and_refuses_new_requests() -> None:
    client = UpstreamClient()
    async with ScriptedServer(serve_ok) as server:
        await (await client.request("GET", server.url, timeout=5)).read_whole(CAP)
        assert client.num_idle == 1
        await client.aclose()
        assert client.num_connections == 0
        with pytest.raises(ClientClosed):
            await client.request("GET", server.url, timeout=5)


async def test_bad_urls_and_headers_are_upstream_errors(client: UpstreamClient) -> None:
    for url in ("https://127.0.0.1/", "http:///x", "http://h:99999/"):
        with pytest.raises(InvalidURL):
            await client.request("GET", url, timeout=1)
    with pytest.raises(InvalidHeader):
        await client.request("GET", "http://127.0.0.1:1/", headers={"X": "a\r\nB: c"}, timeout=1)


@pytest.mark.parametrize("peek_to_end", [False, True])
async def test_bytes_put_back_are_read_first_and_the_connection_still_pooled(client: UpstreamClient,
                                                                             peek_to_end: bool) -> None:
    """:meth:`UpstreamResponse.unread` (a PD retry peeks at a stream's first event): the bytes come back first,
    a whole read returns the body once and gives the connection back to the pool once, even when the peek
    already reached the body's end."""
    async with ScriptedServer(serve_ok) as server:
        response = await client.request("POST", server.url + "/p", body=b"body", timeout=5)
        peeked = bytearray()
        while chunk := await response.next_chunk():
            peeked += chunk
            if not peek_to_end:
                break
        response.unread(bytes(peeked))
        assert await response.read_whole(CAP) == b"POST /p HTTP/1.1||body"
        assert await response.next_chunk() == b""
        assert client.num_idle == 1
        again = await client.request("GET", server.url + "/q", timeout=5)
        assert await again.read_whole(CAP) == b"GET /q HTTP/1.1||"
        assert server.num_connections == 1


async def test_a_responses_deadline_stays_its_own_once_its_connection_is_reused(client: UpstreamClient) -> None:
    """Found by review (stop 46): a response's ``deadline`` was read off its connection, which goes back to the pool
    with the body's last byte: a request that reused it meanwhile (a 1 s health check, a call with no timeout) made
    it that request's, and a buffered answer relayed after an await (a PD merge on a thread) was cut a second after
    a probe's deadline, or never."""
    async with ScriptedServer(serve_ok) as server:
        loop = asyncio.get_running_loop()
        first = await client.request("POST", server.url + "/generate", timeout=3600)
        assert await first.read_whole(CAP) == b"POST /generate HTTP/1.1||"
        deadline = first.deadline
        assert deadline is not None and deadline > loop.time() + 3000
        probe = await client.request("GET", server.url + "/health", timeout=1)
        await probe.read_whole(CAP)
        untimed = await client.request("GET", server.url + "/health")
        assert server.num_connections == 1  # each took the first one's connection from the pool
        assert first.deadline == deadline and untimed.deadline is None
        await untimed.read_whole(CAP)

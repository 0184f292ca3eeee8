"""Requests started now and read later (``UpstreamClient.start``) against real loopback servers."""

from __future__ import annotations

import asyncio
import socket
from typing import Iterator

import pytest

from handoff.service import upstream
from handoff.service.upstream import ConnectFailed, InvalidURL, UpstreamClient
from tests.service.peers import CAP, Conn, ScriptedServer, until
from tests.service.test_upstream import free_port, serve_ok

pytestmark = pytest.mark.timeout(20)


async def warm(client: UpstreamClient, url: str) -> None:
    """Leave one idle connection to ``url`` in the pool."""
    await (await client.request("GET", url, timeout=5)).read_whole(CAP)
    assert client.num_idle == 1


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "new-connection"])
async def test_start_writes_the_request_before_anyone_awaits_it(client: UpstreamClient, pooled: bool) -> None:
    arrived = asyncio.Event()
    release = asyncio.Event()

    async def handler(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            if request[0].startswith("POST"):
                arrived.set()
                await release.wait()
            await conn.respond(200, request[2])

    async with ScriptedServer(handler) as server:
        if pooled:
            await warm(client, server.url)
        pending = client.start("POST", server.url + "/p", body=b"payload", timeout=5)
        await asyncio.wait_for(arrived.wait(), 5)  # nothing awaited the pending request yet
        assert not pending.is_answered
        release.set()
        await until(lambda: pending.is_answered)
        assert await (await pending.response()).read_whole(CAP) == b"payload"
        assert server.num_connections == 1 and client.num_idle == 1


async def test_a_refused_background_connect_is_an_answer_and_a_connect_failed(client: UpstreamClient) -> None:
    pending = client.start("GET", f"http://127.0.0.1:{free_port()}/", timeout=5)
    called = asyncio.Event()
    pending.call_when_answered(called.set)
    await asyncio.wait_for(called.wait(), 5)
    assert pending.is_answered
    with pytest.raises(ConnectFailed):
        await pending.response()


async def test_answered_means_the_whole_body_or_a_full_buffer(client: UpstreamClient) -> None:
    """Headers alone are not an answer (reading the body would wait); a complete body is, and so is one that
    fills the read buffer (a capped read takes it without waiting)."""
    send_rest = asyncio.Event()
    head_and_half = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf."

    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(head_and_half)
        await send_rest.wait()
        conn.writer.write(b"rest.")
        await conn.read_request()
        conn.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4194304\r\n\r\n" + b"x" * (1 << 20))
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        pending = client.start("GET", server.url, timeout=5)
        called = asyncio.Event()
        pending.call_when_answered(called.set)
        # the head and half the body are in (the connection read them); the answer is not
        await until(lambda: pending._conn is not None and pending._conn.num_response_bytes == len(head_and_half))
        assert not pending.is_answered and not called.is_set()
        send_rest.set()
        await asyncio.wait_for(called.wait(), 5)
        assert await (await pending.response()).read_whole(CAP) == b"half.rest."
        big = client.start("GET", server.url, timeout=5)
        await until(lambda: big.is_answered)
        response = await big.response()
        assert await response.read(65536) == b"x" * 65536 and response.is_truncated


@pytest.mark.parametrize("when", ["sent", "connecting", "connected"])
async def test_an_abandoned_request_leaves_no_connection(client: UpstreamClient, when: str) -> None:
    accepted = asyncio.Event()

    async def handler(conn: Conn) -> None:
        accepted.set()
        await serve_ok(conn)

    async with ScriptedServer(handler) as server:
        if when == "sent":
            await warm(client, server.url)
        pending = client.start("GET", server.url, timeout=5)
        if when == "connected":
            await asyncio.wait_for(accepted.wait(), 5)
        pending.close()
        pending.close()  # twice: nothing more
        await until(lambda: client.num_connections == 0)
        with pytest.raises(RuntimeError):
            await pending.response()


async def test_one_response_per_request(client: UpstreamClient) -> None:
    async with ScriptedServer(serve_ok) as server:
        pending = client.start("GET", server.url + "/x", timeout=5)
        response = await pending.response()
        pending.close()  # after the response: the response owns the connection
        assert await response.read_whole(CAP) == b"GET /x HTTP/1.1||"
        with pytest.raises(RuntimeError):
            await pending.response()
        assert client.num_idle == 1


async def test_a_url_that_cannot_be_sent_fails_at_start(client: UpstreamClient) -> None:
    with pytest.raises(InvalidURL):
        client.start("GET", "https://127.0.0.1/", timeout=1)
    pending = client.start("GET", f"http://127.0.0.1:{free_port()}/", timeout=1)
    assert not pending.is_answered  # a refused port is the answer's to tell, not start's: nothing known yet
    with pytest.raises(ConnectFailed):
        await pending.response()


async def test_a_stale_keep_alive_is_retried_in_the_background_before_the_request_counts_as_answered(
        client: UpstreamClient) -> None:
    """The peer closes the pooled connection as the GET goes out: the retry on a fresh connection runs in the
    background, and the request is answered only by it. It ran inside ``response()``, so a reader of answered
    requests waited there on the peer (found by review)."""
    retry_arrived = asyncio.Event()
    answer_retry = asyncio.Event()
    num_requests = 0

    async def handler(conn: Conn) -> None:
        nonlocal num_requests
        while (request := await conn.read_request()) is not None:
            num_requests += 1
            if num_requests == 2:
                return  # the stale keep-alive: read, closed without a byte
            if num_requests == 3:
                retry_arrived.set()
                await answer_retry.wait()
            await conn.respond(200, request[0].encode())

    async with ScriptedServer(handler) as server:
        await warm(client, server.url)
        pending = client.start("GET", server.url + "/again", timeout=5)
        answered = asyncio.Event()
        pending.call_when_answered(answered.set)
        await asyncio.wait_for(retry_arrived.wait(), 5)  # nothing awaited the request: the retry went by itself
        assert not pending.is_answered and not answered.is_set()
        answer_retry.set()
        await asyncio.wait_for(answered.wait(), 5)
        assert await (await pending.response()).read_whole(CAP) == b"GET /again HTTP/1.1"
        assert server.num_connections == 2


async def test_start_many_answers_each_url_in_its_place(client: UpstreamClient) -> None:
    """One request to several URLs: a pooled connection, a new one, a URL that cannot be sent (its error in its
    place); every request is answered, in the order of the URLs."""
    async with ScriptedServer(serve_ok) as pooled, ScriptedServer(serve_ok) as fresh:
        await warm(client, pooled.url)
        started = client.start_many("POST", [pooled.url + "/a", fresh.url + "/b", "http://[::1/c"], body=b"x",
                                    timeout=5)
        assert isinstance(started[2], InvalidURL)
        bodies = []
        for request in started[:2]:
            assert not isinstance(request, Exception)
            bodies.append(await (await request.response()).read_whole(CAP))
        assert bodies == [b"POST /a HTTP/1.1||x", b"POST /b HTTP/1.1||x"]
        assert pooled.num_connections == 1 and client.num_idle == 2


@pytest.mark.parametrize("burst", [2, 1])
async def test_start_many_writes_in_bursts(monkeypatch: pytest.MonkeyPatch, burst: int) -> None:
    """The requests on pooled connections go out back to back once a burst of them is prepared (or the last
    is), not one by one: with bursts of 2, the peer's socket, read without waiting while the second URL is
    still to come, holds nothing yet; with bursts of 1, the first request is there."""
    monkeypatch.setattr(upstream, "WRITE_BURST", burst)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = UpstreamClient()
        try:
            def answer_one_get() -> socket.socket:
                peer, _ = listener.accept()
                peer.settimeout(5)
                assert peer.recv(65536).startswith(b"GET / HTTP/1.1")
                peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                return peer

            listener.settimeout(5)
            answering = asyncio.ensure_future(asyncio.to_thread(answer_one_get))
            await (await client.request("GET", url, timeout=5)).read_whole(CAP)
            with await answering as peer:
                seen_while_preparing: list[bytes] = []

                def urls() -> Iterator[str]:
                    yield url + "/first"
                    peer.setblocking(False)
                    try:
                        seen_while_preparing.append(peer.recv(65536))
                    except BlockingIOError:
                        pass  # nothing written yet, as it should be
                    peer.settimeout(5)
                    yield "http://[::1/not-sent"

                started = client.start_many("POST", urls(), body=b"x", timeout=5)
                assert isinstance(started[1], InvalidURL)
                if burst == 1:
                    assert len(seen_while_preparing) == 1 and seen_while_preparing[0].startswith(b"POST /first ")
                else:
                    assert seen_while_preparing == []
                    assert peer.recv(65536).startswith(b"POST /first HTTP/1.1")  # written when start_many returned
                peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                assert not isinstance(started[0], Exception)
                assert await (await started[0].response()).read_whole(CAP) == b"ok"
        finally:
            await client.aclose()


@pytest.mark.parametrize("burst", [16, 1], ids=["held", "written"])
async def test_start_many_that_raises_leaves_no_request_behind(monkeypatch: pytest.MonkeyPatch, burst: int) -> None:
    """A URL iterator that raises: the exception comes out and no request it started stays in flight, none is
    written after the fact (held, or connecting), and the connections of those already written are closed."""
    monkeypatch.setattr(upstream, "WRITE_BURST", burst)
    seen: list[str] = []
    pooled_closed = asyncio.Event()

    async def record(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            seen.append(request[0])
            if request[0].startswith("GET"):
                await conn.respond(200, b"ok")
        pooled_closed.set()

    client = UpstreamClient()
    try:
        async with ScriptedServer(record) as pooled, ScriptedServer(serve_ok) as fresh:
            await warm(client, pooled.url)

            def urls() -> Iterator[str]:
                yield pooled.url + "/a"
                yield fresh.url + "/b"
                raise RuntimeError("the node list broke")

            with pytest.raises(RuntimeError, match="node list"):
                client.start_many("POST", urls(), body=b"x", timeout=60)
            await asyncio.wait_for(pooled_closed.wait(), 5)
            await until(lambda: client.num_connections == 0)
            assert seen == ["GET / HTTP/1.1"] + (["POST /a HTTP/1.1"] if burst == 1 else [])
            assert fresh.num_connections == 0
    finally:
        await client.aclose()


async def test_start_many_sends_headers_from_an_iterator_with_every_request(client: UpstreamClient) -> None:
    async with ScriptedServer(serve_ok) as server:
        started = client.start_many("POST", [server.url + "/a", server.url + "/b"],
                                    headers=iter([("X-Tag", "t")]), body=b"x", timeout=5)
        bodies = []
        for request in started:
            assert not isinstance(request, Exception)
            bodies.append(await (await request.response()).read_whole(CAP))
        assert bodies == [b"POST /a HTTP/1.1|t|x", b"POST /b HTTP/1.1|t|x"]

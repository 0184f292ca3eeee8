"""Issue 13's client findings, one named test each, against raw-socket fake peers on loopback.

Each test sends real requests through :class:`UpstreamClient` to a peer that
writes exactly the bytes a misbehaving node would.
"""

from __future__ import annotations

import asyncio
import time
import gzip
import tracemalloc

import pytest

from handoff.service.upstream import (
    ConnectFailed,
    InvalidHeader,
    InvalidURL,
    ProtocolError,
    ResponseTooLarge,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeout,
)
from tests.service.peers import CAP, Conn, ScriptedServer, answers, until

pytestmark = pytest.mark.timeout(30)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


# -- item 1: responses cross between clients ------------------------------------------------------
async def test_found_1_continue_then_answer_and_the_next_request_gets_its_own(client: UpstreamClient) -> None:
    """The node sends 100 Continue, then holds its answer until the client's next request comes on the
    same connection (or 0.5 s pass): a client that took the 100 for the answer sends that request and
    would get the first answer for it."""
    async def handler(conn: Conn) -> None:
        await conn.read_request()
        conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await conn.writer.drain()
        try:
            second = await asyncio.wait_for(conn.read_request(), 0.5)
        except asyncio.TimeoutError:
            second = None
        await conn.respond(200, b"first")
        if second is None:
            second = await conn.read_request()
        if second is not None:
            await conn.respond(200, b"second")
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        one = await client.request("POST", server.url + "/generate", body=b"{}", timeout=5)
        assert (one.status, await one.read_whole(CAP)) == (200, b"first")
        two = await client.request("POST", server.url + "/generate", body=b"{}", timeout=5)
        assert (two.status, await two.read_whole(CAP)) == (200, b"second")
        assert server.num_connections == 1  # the pooled connection carried both, each its own answer


async def test_found_1_continue_and_answer_in_one_segment(client: UpstreamClient) -> None:
    interim = b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n"
    async with ScriptedServer(answers(interim + ok(b"first"), ok(b"second"))) as server:
        one = await client.request("POST", server.url, body=b"{}", timeout=5)
        assert (one.status, one.headers, await one.read_whole(CAP)) == (200, [(b"content-length", b"5")], b"first")
        assert await (await client.request("POST", server.url, body=b"{}", timeout=5)).read_whole(CAP) == b"second"
        assert server.num_connections == 1


async def test_found_1_two_answers_in_one_segment_are_not_merged(client: UpstreamClient) -> None:
    async with ScriptedServer(answers(ok(b"hello") + ok(b"world"))) as server:
        response = await client.request("GET", server.url, timeout=5)
        assert await response.read_whole(CAP) == b"hello"
        assert client.num_connections == 0  # a second answer nobody asked for: never pooled
        again = await client.request("GET", server.url, timeout=5)
        assert await again.read_whole(CAP) == b"hello"
        assert server.num_connections == 2


async def test_found_1_late_answer_on_an_idle_connection_never_reaches_the_next_request(
        client: UpstreamClient) -> None:
    sent_late = asyncio.Event()

    async def handler(conn: Conn) -> None:
        await conn.read_request()
        await conn.respond(200, b"mine")
        conn.writer.write(ok(b"stale answer"))  # unrequested, while the connection sits in the pool
        await conn.writer.drain()
        sent_late.set()
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        assert await (await client.request("GET", server.url, timeout=5)).read_whole(CAP) == b"mine"
        await asyncio.wait_for(sent_late.wait(), 5)
        await until(lambda: client.num_connections == 0)
        assert await (await client.request("GET", server.url, timeout=5)).read_whole(CAP) == b"mine"
        assert server.num_connections == 2


async def test_found_1_early_hints_headers_are_not_merged(client: UpstreamClient) -> None:
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\nX-Early: 1\r\n\r\n"
    async with ScriptedServer(answers(early + ok(b"{}", b"Content-Type: application/json\r\n"))) as server:
        response = await client.request("GET", server.url, timeout=5)
        assert response.status == 200 and await response.read_whole(CAP) == b"{}"
        assert response.headers == [(b"content-length", b"2"), (b"content-type", b"application/json")]
        assert response.header("link") is None and response.header("x-early") is None


async def test_found_1_processing_interims_then_a_chunked_answer(client: UpstreamClient) -> None:
    processing = b"HTTP/1.1 102 Processing\r\n\r\n"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\ndone\r\n0\r\n\r\n"
    async with ScriptedServer(answers([processing, processing, chunked], ok(b"next"))) as server:
        assert await (await client.request("GET", server.url, timeout=5)).read_whole(CAP) == b"done"
        assert await (await client.request("GET", server.url, timeout=5)).read_whole(CAP) == b"next"
        assert server.num_connections == 1


# -- item 2: unbounded upstream heads -------------------------------------------------------------
FLOOD_BYTES = 16 * 1024 * 1024
FLOODS = {
    "endless header lines": (b"HTTP/1.1 200 OK\r\n", b"X-Flood: aaaaaaaaaaaaaaaa\r\n" * 4096),
    "one endless header line": (b"HTTP/1.1 200 OK\r\nX-Flood: ", b"a" * 65536),
    "endless interim responses' headers": (b"HTTP/1.1 100 Continue\r\n", b"X-Flood: a\r\n" * 4096),
    "endless trailers": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n",
                         b"X-Trailer: aaaaaaaaaaaaaaaa\r\n" * 4096),
    "endless chunk extension": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=", b"a" * 65536),
}


@pytest.mark.parametrize("flood", FLOODS)
async def test_found_2_endless_heads_cost_bounded_memory(client: UpstreamClient, flood: str) -> None:
    """The peer offers 16 MiB of head; the client stops at its 64 KiB cap with a ProtocolError, its
    Python allocations peaking far below what the peer sent."""
    start, block = FLOODS[flood]
    num_sent = 0

    async def handler(conn: Conn) -> None:
        nonlocal num_sent
        await conn.read_request()
        conn.writer.write(start)
        while num_sent < FLOOD_BYTES:
            conn.writer.write(block)
            num_sent += len(block)
            await conn.writer.drain()
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        tracemalloc.start()
        try:
            with pytest.raises(ProtocolError, match="65536"):
                response = await client.request("GET", server.url, timeout=20)
                await response.read_whole(CAP)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak_bytes < 2 * 1024 * 1024, f"the client held {peak_bytes} bytes at its peak"
        assert client.num_connections == 0
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)  # the client closed: the flood stopped
        assert num_sent < FLOOD_BYTES


async def test_endless_interim_responses_are_cut_off_at_once(client: UpstreamClient) -> None:
    """A peer that sends 100 Continue without end: a ProtocolError after 16, not at the request's deadline."""
    num_sent = 0

    async def handler(conn: Conn) -> None:
        nonlocal num_sent
        await conn.read_request()
        while num_sent < 100_000:
            conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            num_sent += 1
            await conn.writer.drain()
        await conn.reader.read()

    async with ScriptedServer(handler) as server:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="more than 16 interim"):
            await client.request("GET", server.url, timeout=30)
        assert time.monotonic() - started < 10
        assert client.num_connections == 0
        await asyncio.wait_for(server.closed_by_peer.wait(), 5)


async def test_found_2_more_than_100_header_fields_is_a_protocol_error(client: UpstreamClient) -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"Content-Length: 0\r\n\r\n"
    async with ScriptedServer(answers(head)) as server:
        with pytest.raises(ProtocolError, match="more than 100 header fields"):
            await client.request("GET", server.url, timeout=5)


async def test_found_2_a_buffered_read_past_its_cap_is_an_error_or_a_flagged_prefix(
        client: UpstreamClient) -> None:
    big = ok(b"x" * 100_000)
    async with ScriptedServer(answers(big)) as server:
        response = await client.request("GET", server.url, timeout=5)
        with pytest.raises(ResponseTooLarge) as info:
            await response.read_whole(65536)
        assert info.value.max_bytes == 65536 and isinstance(info.value, UpstreamError)
        assert client.num_connections == 0
    async with ScriptedServer(answers(big)) as server:
        response = await client.request("GET", server.url, timeout=5)
        assert await response.read(10) == b"xxxxxxxxxx" and response.is_truncated


# -- item 3: odd statuses, content codings ---------------------------------------------------------
@pytest.mark.parametrize("status", [b"999", b"000", b"101", b"600", b"099"])
async def test_found_3_odd_statuses_are_protocol_errors(client: UpstreamClient, status: bytes) -> None:
    async with ScriptedServer(answers(b"HTTP/1.1 " + status + b" Odd\r\nContent-Length: 2\r\n\r\nhi")) as server:
        with pytest.raises(ProtocolError, match="status|101"):
            await client.request("GET", server.url, timeout=5)
        assert client.num_connections == 0


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_found_3_gzip_body_keeps_its_content_encoding_and_bytes(client: UpstreamClient,
                                                                      framing: str) -> None:
    compressed = gzip.compress(b'{"text": "hello"}' * 50)
    if framing == "chunked":
        half = len(compressed) // 2
        body = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, compressed[:half], len(compressed) - half,
                                                        compressed[half:])
        raw = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    else:
        raw = ok(compressed, b"Content-Encoding: gzip\r\n")
    async with ScriptedServer(answers(raw)) as server:
        response = await client.request("GET", server.url, timeout=5)
        assert response.header("content-encoding") == "gzip"
        assert await response.read_whole(CAP) == compressed


# -- framing rules the fuzz test also covers, as readable cases ----------------------------------
@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nhi",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhiX\r\n0\r\n\r\n",
])
async def test_ambiguous_framing_is_a_protocol_error(client: UpstreamClient, head: bytes) -> None:
    async with ScriptedServer(answers(head)) as server:
        with pytest.raises(ProtocolError):
            response = await client.request("GET", server.url, timeout=5)
            await response.read_whole(CAP)
        assert client.num_connections == 0


async def test_trailers_never_override_headers(client: UpstreamClient) -> None:
    raw = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;name=\"a value\"\r\nhello\r\n0\r\nContent-Type: text/evil\r\nX-Trailer: 1\r\n\r\n")
    async with ScriptedServer(answers(raw, raw)) as server:
        response = await client.request("GET", server.url, timeout=5)
        assert await response.read_whole(CAP) == b"hello"
        assert response.headers == [(b"content-type", b"text/plain"), (b"transfer-encoding", b"chunked")]
        await (await client.request("GET", server.url, timeout=5)).read_whole(CAP)
        assert server.num_connections == 1


async def test_head_request_has_no_body_and_keeps_the_connection(client: UpstreamClient) -> None:
    async with ScriptedServer(answers(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", ok(b"after"))) as server:
        response = await client.request("HEAD", server.url, timeout=5)
        assert response.header("content-length") == "100" and await response.read_whole(CAP) == b""
        assert await (await client.request("GET", server.url, timeout=5)).read_whole(CAP) == b"after"
        assert server.num_connections == 1


# -- item 4 (the client's part): a bad URL or header is one error for that request ----------------
@pytest.mark.parametrize("url", [
    "http://[::1", "http://[::1]x/", "http://[not-v6]:1/", "http://hö.st/", "http://a\x00b/",
    "http://user@127.0.0.1/", "http://127.0.0.1:0/", "http://127.0.0.1:١٢/", "http://" + "a" * 64 + ".b/",
    "http://a..b/", "http://127.0.0.1/a b", "http://127.0.0.1/é", "ftp://127.0.0.1/", "http://:80/",
])
async def test_bad_urls_are_invalid_url(client: UpstreamClient, url: str) -> None:
    with pytest.raises(InvalidURL) as info:
        await client.request("GET", url, timeout=1)
    assert isinstance(info.value, ConnectFailed) and info.value.url == url


@pytest.mark.parametrize("headers", [{"X": "a\x00b"}, {"X": "snow ☃"}, {"Bad Name": "v"}, {"Host": "evil"},
                                     {"Content-Length": "5"}, {"X": None}, {"X": ["a list"]}])
async def test_bad_headers_are_invalid_header(client: UpstreamClient, headers: dict[str, str]) -> None:
    with pytest.raises(InvalidHeader):
        await client.request("GET", "http://127.0.0.1:9/", headers=headers, timeout=1)


async def test_a_fan_out_over_bad_peers_gets_one_upstream_error_each(client: UpstreamClient) -> None:
    async with ScriptedServer(answers(b"HTTP/1.1 999 X\r\n\r\n")) as odd, ScriptedServer(answers(ok(b"fine"))) as good:
        urls = [good.url, odd.url, "http://[::1", "http://name.invalid:80", "http://hö.st", "http://127.0.0.1:1"]

        async def call(url: str) -> bytes:
            return await (await client.request("GET", url + "/x", timeout=3)).read_whole(CAP)

        results = await asyncio.gather(*(call(url) for url in urls), return_exceptions=True)
    assert results[0] == b"fine"
    for url, result in zip(urls[1:], results[1:]):
        assert isinstance(result, (ConnectFailed, ProtocolError, UpstreamTimeout)), (url, result)

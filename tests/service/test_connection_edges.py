"""Edges of the services' connection handling (handoff/service/head_timeout.py) on a kept-alive connection: a
request already sent is never closed as idle, a pipelined head still has its deadline, and a head is bounded in
size."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import socket
import struct
import termios
from typing import AsyncIterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from handoff.service.head_timeout import MAX_HEAD_BYTES, HeadTimeoutProtocol
from handoff.service.http_protocol import ServiceProtocol
from tests.support.lifespan import answered_lifespan, serving
from tests.support.procs import wait_until

HEAD_TIMEOUT_S = 0.5
SLOW_S = 1.5  # /slow answers after this long: longer than the head timeout


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if await answered_lifespan(scope, receive, send):
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def server() -> AsyncIterator[uvicorn.Server]:
    async with serving(app, ServiceProtocol.with_timeout(HEAD_TIMEOUT_S, max_connections=100),
                       timeout_keep_alive=75) as (server, _):
        yield server


def _port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


def _protocols(server: uvicorn.Server) -> list[HeadTimeoutProtocol]:
    return sorted((c for c in server.server_state.connections if isinstance(c, HeadTimeoutProtocol)),
                  key=lambda c: c._number)


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    return head + await reader.readexactly(length)


async def test_a_kept_alive_connection_whose_next_request_is_in_is_not_closed_as_idle(
        server: uvicorn.Server) -> None:
    """Past --max-connections the oldest idle connection makes way; one whose next request already arrived (in
    the socket, not read yet: the loop is busy) has a request in progress. Before the fix it was closed with the
    request unread: the client, still there, got a reset for a request it had sent (no retry for a POST)."""
    port = _port(server)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    streams = [await asyncio.open_connection(sock=sock) for sock in socks]
    for _, writer in streams:
        writer.write(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
    for reader, _ in streams:
        assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/first")
    oldest, newer, newest = _protocols(server)
    (reader, _), (newer_reader, _), _ = streams
    # the oldest one's next request reaches the server's socket while its loop is busy elsewhere: no await from
    # the send to the bound's check, so the server has not read it
    socks[0].send(b"POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    # a blocking poll: the bytes cross the loopback without the loop running
    wait_until(lambda: _unread_bytes(oldest), timeout=5, interval=0.001, what="the request in the server's socket")
    assert newest._close_oldest_idle() is True  # what a new connection past the bound does
    assert not oldest.transport.is_closing() and newer.transport.is_closing()
    assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/second")
    assert await asyncio.wait_for(newer_reader.read(), 5) == b""  # the idle one made way instead
    for _, writer in streams:
        writer.close()


def _unread_bytes(protocol: HeadTimeoutProtocol) -> int:
    """What arrived in the server's socket and was not read yet."""
    fd = protocol.transport.get_extra_info("socket").fileno()
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


async def test_a_pipelined_head_that_starts_during_an_answer_still_has_its_deadline(server: uvicorn.Server) -> None:
    """A request head that begins while the previous answer is in progress must still arrive within the head
    timeout: past it, once that answer is out, it is a 408 and the connection closes. Before the fix its timer
    was dropped (fired during the answer, or disarmed when the answer completed): a client could dribble a
    head for as long as it liked after a slow request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTTP/1.1\r\nHo")  # the next head stalls
    assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/slow")
    late = await asyncio.wait_for(reader.read(), SLOW_S + 2 * HEAD_TIMEOUT_S)  # the 408, then the close
    assert late.startswith(b"HTTP/1.1 408 "), late
    writer.close()


async def test_a_pipelined_head_completed_in_time_is_answered(server: uvicorn.Server) -> None:
    """The deadline of a head that started during an answer is the head's own: in time, it is served."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTTP/1.1\r\nHo")
    await writer.drain()
    writer.write(b"st: x\r\n\r\n")
    assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/slow")
    assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/next")
    writer.close()


async def _send_until_answered(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, chunk: bytes,
                               max_bytes: int) -> tuple[bytes, int]:
    """Write ``chunk`` again and again until the server answers (or ``max_bytes`` are out); the answer and the
    bytes written."""
    answer = asyncio.ensure_future(reader.read())
    sent = 0
    try:
        while not answer.done() and sent < max_bytes:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
            await asyncio.sleep(0)  # a turn for the reader (drain yields only when the buffer is full)
    except ConnectionError:
        pass  # closed by the server: its answer is read below
    return await asyncio.wait_for(answer, 5), sent


@pytest.mark.parametrize("line", [b"X-Filler: " + b"a" * 1000 + b"\r\n", b"a" * 1000], ids=["lines", "one-value"])
async def test_an_endless_head_is_431_within_its_bound(server: uvicorn.Server, line: bytes) -> None:
    """Header lines (or one header value) sent without end: a 431 ``head_too_large`` once the head passes
    ``MAX_HEAD_BYTES`` (a read more at most), the connection closed. Before, httptools kept every byte until the
    head deadline (a client grew the LB by 2 GiB in 3 s) and the client got a 408 from the deadline."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\n" + (b"X-Long: " if line.startswith(b"a") else b""))
    answer, sent = await _send_until_answered(writer, reader, line, max_bytes=64 * MAX_HEAD_BYTES)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b'"type": "head_too_large"' in answer or b'"type":"head_too_large"' in answer, answer
    assert sent < 8 * MAX_HEAD_BYTES, sent
    writer.close()


async def test_a_head_within_the_bound_is_served_whatever_follows_it(server: uvicorn.Server) -> None:
    """A head just under the bound, and a small head with a large body in the same write, are answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    filler = b"X-Filler: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n"
    body = b"b" * (4 * MAX_HEAD_BYTES)
    writer.write(b"GET /big-head HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\n"
                 + b"POST /big-body HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/big-head")
    assert (await asyncio.wait_for(_answer(reader), 5)).endswith(b"/big-body")
    writer.close()


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES + 100, 2 * MAX_HEAD_BYTES], ids=["just-over", "twice"])
async def test_a_head_over_the_bound_that_arrives_at_once_is_431(server: uvicorn.Server, size: int) -> None:
    """A head past ``MAX_HEAD_BYTES`` written in one go, complete in the read or two it arrives in: 431 as one
    sent slowly is. Before, the bound was looked at only while the head was still incomplete after a read, so
    a head of up to about two reads (130 KB on loopback) was served."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    filler = b"X-Filler: " + b"a" * (size - 40) + b"\r\n"
    writer.write(b"GET /too-big HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\n"
                 + b"POST /after HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    answer = await asyncio.wait_for(reader.read(), 5)  # one answer, then the connection closes
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert answer.count(b"HTTP/1.1") == 1 and b"head_too_large" in answer, answer
    assert b"/too-big" not in answer and b"/after" not in answer, answer
    writer.close()


@pytest.mark.parametrize("line", [b"X-Trailer: " + b"a" * 1000 + b"\r\n", b"a" * 1000], ids=["lines", "one-value"])
async def test_endless_trailers_close_the_connection_within_the_bound(server: uvicorn.Server, line: bytes) -> None:
    """A chunked body's trailer lines (or one trailer value) sent without end: the connection is closed once
    they pass ``MAX_HEAD_BYTES`` (a read more at most). Before, httptools kept every trailer line, past the head's
    bound and its deadline (a client grew a process by 2 GiB in 3 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"
                 + (b"X-Trailer: " if line.startswith(b"a") else b""))
    closed = asyncio.ensure_future(reader.read())
    sent = 0
    with contextlib.suppress(ConnectionError):  # closed with trailer bytes unread: a reset
        while not closed.done() and sent < 64 * MAX_HEAD_BYTES:
            writer.write(line)
            await writer.drain()
            sent += len(line)
            await asyncio.sleep(0)
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(closed, 5) == b""
    assert sent < 8 * MAX_HEAD_BYTES, sent
    writer.close()


async def test_a_request_httptools_refuses_is_the_error_envelope(server: uvicorn.Server) -> None:
    """Content-Length with Transfer-Encoding (a smuggling attempt) is a 400 ``invalid_request`` envelope, like
    every other error, not uvicorn's plain text; the request smuggled behind it is never served."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head, answer
    assert json.loads(body)["error"]["type"] == "invalid_request", answer
    assert b"/smuggled" not in answer
    writer.close()


async def test_a_bad_request_pipelined_behind_one_being_answered_is_answered_after_it(
        server: uvicorn.Server) -> None:
    """A malformed request sent right behind one whose answer is not out yet: that answer comes first, then the
    400. Before, uvicorn wrote the 400 at once and closed: the client read it as the answer to its good request,
    whose own answer never came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab")
    first = await asyncio.wait_for(_answer(reader), 5)
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"/slow"), first
    rest = await asyncio.wait_for(reader.read(), 5)
    assert rest.startswith(b"HTTP/1.1 400 ") and b'"invalid_request"' in rest, rest
    writer.close()

"""The services' answers by the request's HTTP version (handoff/service/http_protocol.py), over real loopback
connections to a real uvicorn server: a stream to an HTTP/1.0 request is close-delimited (RFC 9112 6.1: no
Transfer-Encoding to a 1.0 client), while HTTP/1.1 streams stay chunked and kept alive; versions other than 1.0
and 1.1 are a 505."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import pytest
from starlette.types import Receive, Scope, Send

from handoff.service.http_protocol import ServiceProtocol
from tests.support.lifespan import answered_lifespan, serving

pytestmark = pytest.mark.timeout(60)
EVENTS = [b"data: {\"text\": \"a\"}\n\n", b"data: [DONE]\n\n"]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if await answered_lifespan(scope, receive, send):
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"].startswith("/stream"):  # an SSE stream (no Content-Length), as /generate with stream true
        headers = [(b"content-type", b"text/event-stream")]
        if scope["path"] == "/stream-te":  # one that names its coding itself
            headers.append((b"transfer-encoding", b"chunked"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in EVENTS:
            await asyncio.sleep(0)  # each event in a later turn: the head goes out by itself
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with serving(app, ServiceProtocol.with_timeout(5.0)) as (_, port):
        yield port


async def _until_closed(port: int, request: bytes) -> tuple[list[bytes], bytes]:
    """The answer's head lines (lower-case) and everything after its head, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    received = await asyncio.wait_for(reader.read(), 10)  # to EOF: fails by timeout if the server keeps it open
    writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    return head.lower().split(b"\r\n"), body


@pytest.mark.parametrize("path", ["/stream", "/stream-te"])
async def test_a_stream_to_an_http10_request_is_close_delimited(port: int, path: str) -> None:
    """HTTP/1.0 (nginx's default upstream version, ``curl -0``) has no chunked coding: a 1.0 client read the
    chunk-size lines as its body. The stream is sent as it is, ended by the close."""
    head, body = await _until_closed(port, f"GET {path} HTTP/1.0\r\n\r\n".encode())
    assert head[0] == b"http/1.1 200 ok" and b"connection: close" in head, head
    assert not any(line.startswith(b"transfer-encoding") for line in head), head
    assert body == b"".join(EVENTS)


async def test_http11_streams_stay_chunked_and_kept_alive(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(2):
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).lower()
            assert b"transfer-encoding: chunked\r\n" in head and b"connection" not in head, head
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in EVENTS) + b"0\r\n\r\n"
            assert await asyncio.wait_for(reader.readexactly(len(chunks)), 10) == chunks
    finally:
        writer.close()


@pytest.mark.parametrize("version", ["1.0", "1.1"])
async def test_head_to_a_stream_has_no_body_and_no_coding(port: int, version: str) -> None:
    head, body = await _until_closed(port, f"HEAD /stream HTTP/{version}\r\nHost: x\r\nConnection: close\r\n\r\n"
                                     .encode())
    assert head[0] == b"http/1.1 200 ok" and body == b"", (head, body)
    assert not any(line.startswith((b"transfer-encoding", b"content-length")) for line in head), head


async def test_an_http10_keep_alive_request_is_answered_and_closed(port: int) -> None:
    """uvicorn keeps no HTTP/1.0 connection alive (RFC 9112 9.3 lets it close): it says so and closes."""
    head, body = await _until_closed(port, b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert b"content-length: 2" in head and b"connection: close" in head and body == b"ok", (head, body)


@pytest.mark.parametrize("request_line", [b"GET / HTTP/2.0\r\nHost: x", b"GET / HTTP/0.9\r\nHost: x", b"GET /"])
async def test_versions_other_than_10_and_11_are_505(port: int, request_line: bytes) -> None:
    """httptools reads ``HTTP/2.0`` and ``HTTP/0.9`` (and a request line without a version as 0.9): they were
    served as if HTTP/1.1."""
    head, body = await _until_closed(port, request_line + b"\r\n\r\n")
    assert head[0] == b"http/1.1 505 http version not supported" and b"connection: close" in head, head
    error = json.loads(body)["error"]
    assert error["type"] == "http_version_not_supported" and "HTTP/1.1" in error["message"], error


async def test_a_505_pipelined_behind_an_answer_follows_it(port: int) -> None:
    head, body = await _until_closed(port, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/2.0\r\nHost: x\r\n\r\n")
    assert head[0] == b"http/1.1 200 ok" and body.startswith(b"ok") and b" 505 " in body, (head, body)

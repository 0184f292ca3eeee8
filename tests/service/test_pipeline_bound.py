"""A client pipelining requests while it reads the answers must not queue requests in a service without bound
(handoff/service/http_protocol.py): uvicorn resumes reading after every answer, so each answer let one more read
of pipelined requests (up to 256 KiB: thousands of small GETs) join the queue."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
from starlette.types import Receive, Scope, Send

from handoff.service.http_protocol import MAX_PIPELINED, ServiceProtocol
from tests.support.lifespan import answered_lifespan, serving

REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 1000 + b"\r\n\r\n"
NUM_FIRST = 3 * MAX_PIPELINED
NUM_SECOND = 1200  # more than four reads of the server's (256 KiB: 250 of these requests)
ONE_READ = 256 * 1024 // len(REQUEST) + 1


class _Observed(ServiceProtocol):
    longest = 0  # the longest queue of pipelined requests seen, over every connection

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        _Observed.longest = max(_Observed.longest, len(self.pipeline))


gate: list[asyncio.Event] = []


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if await answered_lifespan(scope, receive, send):
        return
    await gate[0].wait()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    gate[:] = [asyncio.Event()]
    _Observed.longest = 0
    async with serving(app, _Observed.with_timeout(5.0, max_connections=100)) as (_, port):
        yield port
        gate[0].set()


async def test_requests_pipelined_behind_answers_being_read_stay_bounded(port: int) -> None:
    """Requests pipelined behind a first one the app holds, then more than a read's worth: before the fix each
    answer resumed reading, so every answer added a read of requests to the queue (1,500 queued); now the server
    reads no more while ``MAX_PIPELINED`` wait (a read's worth more at most), and every request is answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST * (1 + NUM_FIRST))
    await writer.drain()
    async with asyncio.timeout(10):  # the first batch read (reading paused behind the held request), then more sent
        while _Observed.longest < MAX_PIPELINED:
            await asyncio.sleep(0.01)
    writer.write(REQUEST * NUM_SECOND)
    await writer.drain()
    gate[0].set()
    marker = b"\r\n\r\nok"  # the end of each answer
    num_answers, tail = 0, b""
    async with asyncio.timeout(30):
        while num_answers < 1 + NUM_FIRST + NUM_SECOND:
            chunk = await reader.read(65536)
            assert chunk, f"the connection closed after {num_answers} answers"
            num_answers += (tail + chunk).count(marker)
            tail = (tail + chunk)[-(len(marker) - 1):]
    writer.close()
    assert _Observed.longest <= MAX_PIPELINED + ONE_READ, f"{_Observed.longest} requests queued"

"""The sidecar's engine client against a real loopback listener: what a generation that got no answer was."""

from __future__ import annotations

import asyncio
import socket

import pytest

from handoff.protocol import errors as E
from handoff.service.errors import ServiceError
from handoff.service.upstream import TimedOutConnecting, UpstreamClient, UpstreamError
from node_sidecar.engine_client import EngineClient
from node_sidecar.errors import EngineUnavailable
from tests.service.peers import ScriptedServer, never_answer

pytestmark = pytest.mark.timeout(20)


async def test_a_generation_that_never_got_a_connection_is_not_overdue() -> None:
    """An engine whose accept queue is full (a hung engine: the kernel drops the SYN) never got the request: a
    503 the LB may send elsewhere, and the engine counted unreachable. It was a 504 ``upstream_timeout`` ("it may
    have run, so it is not sent elsewhere"), the engine not reported (found by review)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # one connection queued, never accepted; the next one's SYN is dropped
        with socket.create_connection(listener.getsockname(), timeout=2):
            host, port = listener.getsockname()
            reported: list[UpstreamError] = []
            client = UpstreamClient()
            engine = EngineClient(f"http://{host}:{port}", client, control_timeout=5, on_unreachable=reported.append)
            try:
                with pytest.raises((EngineUnavailable, ServiceError)) as info:
                    await engine.open("POST", "/generate", body=b"{}", timeout=0.5, is_generation=True)
            finally:
                await client.aclose()
    assert isinstance(info.value.__cause__, TimedOutConnecting), info.value.__cause__
    assert isinstance(info.value, EngineUnavailable) and info.value.type != E.UPSTREAM_TIMEOUT.name, info.value
    assert len(reported) == 1


UNTYPED = [  # the engine's status and body -> what the sidecar answers
    (400, b'{"error": {"message": "bad field"}}', 400, E.INVALID_REQUEST.name, "bad field"),  # SGLang's shape
    (422, b'{"detail": [{"msg": "field required"}]}', 400, E.INVALID_REQUEST.name, "field required"),  # FastAPI's
    (500, b"Internal Server Error", 500, E.INTERNAL_ERROR.name, "Internal Server Error"),
    (503, b'{"error": {"type": 7, "message": "busy"}}', 503, E.UNAVAILABLE.name, "busy"),
    (418, b"teapot", 502, E.UPSTREAM_ERROR.name, "answered 418: teapot"),
    (409, b'{"error": {"type": "requests_in_flight", "message": "m"}}', 409, E.REQUESTS_IN_FLIGHT.name, "m"),
    (400, b'{"error": {"type": "BadRequestError", "message": "m"}}', 400, "BadRequestError", "m"),  # an engine's own
]


@pytest.mark.parametrize(("status", "body", "answered", "kind", "text"), UNTYPED)
async def test_an_engine_error_naming_no_type_takes_the_type_of_its_status(status: int, body: bytes, answered: int,
                                                                          kind: str, text: str) -> None:
    """An error the engine answered without a type of its own was passed on as ``engine_error``, a type no
    module defines, with whatever status the engine gave (found by review): now the type of its status, so every
    type the sidecar answers has one status."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = UpstreamClient()
    try:
        engine = EngineClient(f"http://127.0.0.1:{port}", client, control_timeout=5, on_unreachable=lambda _: None)
        with pytest.raises(ServiceError) as info:
            await engine.call("GET", "/model_info")
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert (info.value.status, info.value.type) == (answered, kind)
    assert text in str(info.value)


@pytest.mark.parametrize("spent", [0, 0.0, -1.5])
async def test_a_spent_deadline_is_answered_at_once_and_sends_nothing(spent: float) -> None:
    """A control call given no time left (a ``flush_cache`` that waited out its caller's deadline behind another
    control call) read its 0 as "no timeout given" and waited the whole ``--control-timeout`` on an engine that
    does not answer, well past the caller's deadline (found by review). Now a 504 ``upstream_timeout`` at once,
    nothing sent and the engine not counted unreachable."""
    reported: list[UpstreamError] = []
    client = UpstreamClient()
    loop = asyncio.get_running_loop()
    try:
        async with ScriptedServer(never_answer) as server:
            engine = EngineClient(server.url, client, control_timeout=10, on_unreachable=reported.append)
            started = loop.time()
            with pytest.raises(ServiceError) as info:
                await engine.call("POST", "/flush_cache", timeout=spent)
            took = loop.time() - started
    finally:
        await client.aclose()
    assert took < 5, took  # at once, not the 10 s control timeout
    assert (info.value.status, info.value.type) == (504, E.UPSTREAM_TIMEOUT.name), info.value
    assert info.value.extra["sent"] is False and "POST /flush_cache" in info.value.message
    assert server.num_connections == 0 and not reported

"""The client's timeout bounds the whole call, its retries and their waits included, and whatever the transport
raises on the way is one :class:`HandoffError`."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Callable

import httpx
import pytest

from handoff.client import AsyncHandoffClient, HandoffClient, HandoffError, RetryPolicy, ServiceUnavailable
from tests.handoff.scripted import UNAVAILABLE, received, script

pytestmark = pytest.mark.timeout(60)

_REFUSAL = json.dumps({"error": {"type": "no_available_node", "message": "all released"}}).encode()


def _refused_once_then_dribbled() -> Callable[[socket.socket], None]:
    """A raw server's behaviour: the first request is a 503 (``Retry-After: 3``), every later one a head
    dribbled a byte every 50 ms for 10 s (a stream does not start either)."""
    calls: list[int] = []

    def behave(conn: socket.socket) -> None:
        calls.append(1)
        if len(calls) == 1:
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 3\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        for _ in range(200):
            conn.sendall(b"a")
            time.sleep(0.05)
    return behave


def test_a_retried_call_never_outlasts_its_timeout(raw_server) -> None:
    """Each attempt had the whole timeout: a 503, a 1 s wait, then a slow answer held a timeout=3 call 4 s
    (``max_attempts`` × timeout + ``max_wait_s`` at worst). Here a 3 s wait and timeout=6: 6 s, where each
    attempt given the whole timeout takes 9 s."""
    retry = RetryPolicy(max_attempts=3, max_wait_s=60)
    for call in (lambda c: c.generate("x"), lambda c: next(iter(c.stream_generate("x")))):
        url = raw_server(_refused_once_then_dribbled())
        started = time.monotonic()
        with HandoffClient(url, timeout=6.0, retry=retry) as client:
            with pytest.raises(HandoffError) as info:
                call(client)
        assert (info.value.status, info.value.type) == (0, "timeout") and time.monotonic() - started < 7.5

    async def run_async() -> HandoffError:
        url = raw_server(_refused_once_then_dribbled())
        async with AsyncHandoffClient(url, timeout=6.0, retry=retry) as client:
            with pytest.raises(HandoffError) as info:
                await client.generate("x")
        return info.value

    started = time.monotonic()
    assert asyncio.run(run_async()).type == "timeout" and time.monotonic() - started < 7.5


def test_a_wait_that_would_end_past_the_timeout_is_not_made(server) -> None:
    """Retry-After 2 s, a timeout of 3.5 s: two attempts (at 0 and 2 s), then the last 503 at once, not
    eight more attempts past the call's timeout. (A wait of 2 s leaves each attempt 1.5 s of room.)"""
    later = {**UNAVAILABLE, "headers": {"Retry-After": "2"}}
    for make in (HandoffClient, AsyncHandoffClient):
        script(server, *[later] * 10)
        num_received = len(received(server))
        started = time.monotonic()
        client = make(server.url, timeout=3.5, retry=RetryPolicy(max_attempts=10, max_wait_s=60))
        with pytest.raises(ServiceUnavailable):
            if isinstance(client, HandoffClient):
                with client:
                    client.generate("hi")
            else:
                asyncio.run(_generate_once(client))
        assert time.monotonic() - started < 3.5
        assert len(received(server)) == num_received + 2


async def _generate_once(client: AsyncHandoffClient) -> None:
    async with client:
        await client.generate("hi")


class _TimingOutTransport(httpx.BaseTransport):
    """A transport that raises Python's own ``TimeoutError`` (as a WSGI app or a wrapping transport may)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        raise TimeoutError("the transport's own timeout")


class _AsyncTimingOutTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise TimeoutError("the transport's own timeout")


def test_a_transports_own_timeout_error_is_a_handoff_error() -> None:
    """The sync client took the work's ``TimeoutError`` for its own wait's, found the work done, and re-raised
    it: a built-in ``TimeoutError`` escaped instead of a ``HandoffError``."""
    with HandoffClient("http://127.0.0.1:1", transport=_TimingOutTransport()) as client:
        for call in (lambda: client.generate("x"), lambda: next(iter(client.stream_generate("x")))):
            with pytest.raises(HandoffError) as info:
                call()
            assert (info.value.status, info.value.type) == (0, "timeout")

    async def run_async() -> HandoffError:
        async with AsyncHandoffClient("http://127.0.0.1:1", transport=_AsyncTimingOutTransport()) as client:
            with pytest.raises(HandoffError) as info:
                await client.generate("x")
        return info.value

    assert asyncio.run(run_async()).type == "timeout"

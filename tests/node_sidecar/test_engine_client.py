"""The sidecar's engine client against a real loopback listener: what a generation that got no answer was."""

from __future__ import annotations

import socket

import pytest

from handoff.protocol import errors as E
from handoff.service.errors import ServiceError
from handoff.service.upstream import TimedOutConnecting, UpstreamClient, UpstreamError
from node_sidecar.engine_client import EngineClient
from node_sidecar.errors import EngineUnavailable

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

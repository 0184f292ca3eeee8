"""An adapter's ``flush_cache`` against an engine that never answers: what a caller's deadline does to it."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

from handoff.protocol import errors as E
from handoff.service.errors import ServiceError
from handoff.service.upstream import UpstreamClient
from node_sidecar.engine_client import EngineClient
from node_sidecar.errors import EngineUnavailable
from tests.service.peers import ScriptedServer, never_answer


async def flush_deadlines(make_adapter: Callable[[EngineClient], Any], spent: tuple[float, ...],
                          late_s: float) -> tuple[float, EngineUnavailable, int]:
    """Each deadline in ``spent`` must be a 504 at once with nothing sent; then a flush given ``late_s`` seconds
    runs out: its duration, its error and the connections the engine saw."""
    client = UpstreamClient()
    loop = asyncio.get_running_loop()
    try:
        async with ScriptedServer(never_answer) as server:
            adapter = make_adapter(EngineClient(server.url, client, control_timeout=10,
                                                on_unreachable=lambda _: None))
            for deadline in spent:
                with pytest.raises(ServiceError) as refused:
                    await adapter.flush_cache(deadline)
                assert (refused.value.status, refused.value.type) == (504, E.UPSTREAM_TIMEOUT.name), refused.value
                assert refused.value.extra["sent"] is False and server.num_connections == 0
            started = loop.time()
            with pytest.raises(EngineUnavailable) as late:
                await adapter.flush_cache(late_s)
            return loop.time() - started, late.value, server.num_connections
    finally:
        await client.aclose()

"""A control fan-out cancelled part way (the LB shutting down under it), in process against loopback nodes:
every fence it raised is lifted and no request it started keeps a connection."""

from __future__ import annotations

import asyncio

import pytest

from handoff.service.upstream import UpstreamClient
from lb.config import LBConfig, NodeSpec
from lb.fanout import FanOut
from lb.health import HealthMonitor
from lb.membership import Membership
from lb.metrics import LBMetrics
from lb.node import NodeHealth
from tests.service.peers import Conn, ScriptedServer, until

pytestmark = pytest.mark.timeout(20)


async def test_a_cancelled_fanout_lifts_its_fences_and_closes_its_requests() -> None:
    answered = asyncio.Event()

    async def answer_at_once(conn: Conn) -> None:
        while await conn.read_request() is not None:
            await conn.respond(200, b'{"success": true}', extra="Content-Type: application/json\r\n")
            answered.set()

    async def never_answer(conn: Conn) -> None:
        await conn.read_request()
        await conn.reader.read()

    client = UpstreamClient()
    metrics = LBMetrics()
    membership = Membership(metrics)
    async with ScriptedServer(answer_at_once) as quick, ScriptedServer(never_answer) as hung, \
            ScriptedServer(never_answer) as hung_too:
        nodes = [membership.add(NodeSpec(server.url), "test") for server in (hung, quick, hung_too)]
        for node in nodes:
            node.set_health(NodeHealth.HEALTHY)
            node.set_serving(True, "open")
        fanout = FanOut(client, membership, HealthMonitor(client, membership, LBConfig(), {}), metrics, {})
        call = asyncio.ensure_future(fanout.run("POST", "/release_memory_occupation", b"{}", "application/json",
                                                None, 10.0))
        await asyncio.wait_for(answered.wait(), 5)
        await until(lambda: client.num_connections == 3)
        assert all(node.num_fences == 1 and not node.is_routable for node in nodes)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert [node.num_fences for node in nodes] == [0, 0, 0]
        await until(lambda: client.num_connections == client.num_idle)  # the hung nodes' connections closed
        assert client.num_idle <= 1
    await client.aclose()

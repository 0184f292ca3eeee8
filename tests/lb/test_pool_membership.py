"""The LB's pooled connections to a node that leaves the membership: closed, never kept open for good (review C).

The fake nodes never close an idle keep-alive connection themselves (as a node that died without a FIN, or
behind a partition, never does): what they count open is what the LB still holds.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.lb.behaviours import Gate
from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(40)


def test_idle_connections_to_a_removed_node_are_closed_when_it_leaves(fakes: FakeCluster, start_lb) -> None:
    node = fakes.start_one()
    # no health check in flight as the node leaves (its connection would go back to the pool after: the next test)
    lb = start_lb("--health-interval", "60", fast_health=False)
    lb.http.post("/nodes", json={"url": node.url}).raise_for_status()
    assert lb.http.post("/flush_cache").status_code == 200
    assert node.conns  # the LB keeps its connection to the node for the next call
    lb.http.delete("/nodes", params={"url": node.url}).raise_for_status()
    wait_until(lambda: not node.conns, timeout=3, what="the removed node's idle connections closed")


def test_a_connection_busy_when_its_node_left_is_not_kept_open(fakes: FakeCluster, start_lb) -> None:
    """A fan-out in flight as the node leaves: its connection goes back to the pool after the removal, and is
    closed once it has idled past the pool's limit (4 s), not kept open for good."""
    gate = Gate(fakes)
    arrived = threading.Event()

    async def gated(node: FakeNode, ex: Exchange) -> None:
        arrived.set()
        await gate.wait()
        ex.respond(200, {"success": True})

    node = fakes.start_one()
    node.handlers["/flush_cache"] = gated
    lb = start_lb()
    lb.http.post("/nodes", json={"url": node.url}).raise_for_status()
    answers: list[httpx.Response] = []
    call = threading.Thread(target=lambda: answers.append(lb.http.post("/flush_cache")))
    call.start()
    assert arrived.wait(10)
    lb.http.delete("/nodes", params={"url": node.url}).raise_for_status()
    gate.open()
    call.join(10)
    assert answers[0].status_code == 200 and answers[0].json()["total"] == 1
    wait_until(lambda: not node.conns, timeout=12, what="the removed node's connections closed")
    fresh = fakes.start_one()  # the LB still makes and pools connections to members as before
    lb.http.post("/nodes", json={"url": fresh.url}).raise_for_status()
    assert lb.http.post("/flush_cache").status_code == 200
    assert lb.http.post("/flush_cache").status_code == 200

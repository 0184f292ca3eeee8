"""A health check under way while the node told the LB something newer (real LB process, fake nodes): the newer
word wins. Control answers carrying a state are covered in ``test_fanout_in_process.py``; here a generation's
503 ``node_released``."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.lb.behaviours import Gate
from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(60)


class _HeldCheck:
    """The node's ``/memory_occupation``: answered at once until :meth:`arm`; then the next check reads the node's
    state, waits for :attr:`answer` and answers what it read, and every later check waits until the LB gives up
    (no later check corrects what the held one left)."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.answer = Gate(cluster)
        self.read = threading.Event()
        self.num_later = 0
        self._is_armed = False

    def arm(self) -> None:
        self._is_armed = True

    async def __call__(self, node: FakeNode, ex: Exchange) -> None:
        if not self._is_armed:
            ex.respond(200, node.state)
        elif self.read.is_set():
            self.num_later += 1
            await ex.wait_closed()
        else:
            state: dict[str, Any] = node.state
            self.read.set()
            await self.answer.wait()
            ex.respond(200, state)


def test_a_check_under_way_does_not_undo_a_generations_503(fakes: FakeCluster, start_lb) -> None:
    """Found by review: a node answering a generation 503 ``node_released`` was marked not serving, but a check
    that had read it serving before and answered after took it back to serving: requests went to the released
    node (each a 503 and a retry) until the next check. The 503 now counts as the node's newer word."""
    node = fakes.start_one()
    check = node.handlers["/memory_occupation"] = _HeldCheck(fakes)
    lb = start_lb("--node", node.url, "--health-interval", "0.2", "--health-timeout", "30", fast_health=False)
    lb.wait_routable([node.url])
    check.arm()
    assert check.read.wait(10), "no health check came"  # it read the node serving, and waits
    node.set_released()
    answer = lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node", answer.text
    assert lb.node(node.url)["routable"] is False
    check.answer.open()  # the held check answers "serving"; the next round starts only once it was taken
    wait_until(lambda: check.num_later > 0, timeout=10, what="the round after the held check")
    view = lb.node(node.url)
    assert view["routable"] is False, view
    assert lb.http.post("/generate", json={"text": "x"}).status_code == 503
    assert len(node.requests_to("/generate")) == 1  # the second request was not sent to the released node

"""Node answers of valid JSON but the wrong shape: what the LB concludes from them and what it shows."""

from __future__ import annotations

import pytest

from handoff.protocol.control import NODE_STATE_HEADER
from tests.lb.behaviours import reply
from tests.lb.fakes import Exchange, FakeCluster, FakeNode, sidecar_state
from tests.lb.lbproc import LB, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("state", [
    {"error": {"type": "engine_unavailable", "message": "the engine is down"}},
    {"success": False, "message": "no state"},
    {},
    {**sidecar_state(), "serving": "false"},
    {**sidecar_state(), "serving": None},
])
def test_a_state_that_is_no_node_state_is_a_failed_check(module_fakes: FakeCluster, shared_lb: LB,
                                                         state: dict) -> None:
    """Without a ``serving`` of true or false, a state was judged as an engine's by tags it did not have: an
    error body, ``{}`` or ``"serving": "false"`` made the node healthy and routable."""
    good, odd = module_fakes.start(2)
    odd.handlers["/memory_occupation"] = reply(200, state)
    set_members(shared_lb, good.url, odd.url)
    wait_until(lambda: shared_lb.node(odd.url)["health"] == "unhealthy", timeout=5, what="odd node unhealthy")
    assert shared_lb.node(odd.url)["routable"] is False
    assert "no node's state" in shared_lb.node(odd.url)["last_error"]
    for _ in range(4):
        assert shared_lb.http.post("/generate", json={"text": "x"}).json()["node"] == good.url


def test_huge_byte_counts_never_make_the_cluster_view_a_500(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Two nodes' 4,300-digit counts summed to 4,301 digits: a 200 that no Python JSON reader takes."""
    nodes = module_fakes.start(2)
    huge = int("9" * 4300)
    for node in nodes:
        state = sidecar_state()
        state["tags"]["weights"]["bytes"] = huge
        state["device"] = {"free_bytes": huge, "total_bytes": -5}
        node.handlers["/memory_occupation"] = reply(200, state)
    set_members(shared_lb, *(n.url for n in nodes))
    answer = shared_lb.http.get("/memory_occupation")
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert view["tags"]["weights"]["bytes"] == 0 and view["tags"]["kv_cache"]["bytes"] == 2000
    assert view["device"] == {"free_bytes": 0, "total_bytes": 0}


@pytest.mark.parametrize("body", [{"success": "false"}, {"success": None},
                                  {"error": {"type": "engine_unavailable", "message": "down"}}])
def test_a_2xx_that_does_not_say_success(module_fakes: FakeCluster, shared_lb: LB, body: dict) -> None:
    """Only ``"success": false`` failed a 2xx: a success that is no boolean, or an error body, passed."""
    good, odd = module_fakes.start(2)
    odd.handlers["/flush_cache"] = reply(200, body)
    set_members(shared_lb, good.url, odd.url)
    answer = shared_lb.http.post("/flush_cache")
    assert answer.status_code == 502, answer.text
    [failure] = answer.json()["failures"]
    assert failure["node"] == odd.url and failure["reason"] == "success_false"


def test_a_state_header_that_is_no_state(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """A release answered with the state header ``{}`` was adopted as a state that serves: the released node
    routable again. Such a header is not adopted; the node is checked instead."""
    node, = module_fakes.start(1)
    set_members(shared_lb, node.url)
    shared_lb.wait_routable([node.url])

    async def release(fake: FakeNode, ex: Exchange) -> None:
        fake.set_released(True)
        ex.respond(200, {"success": True}, headers={NODE_STATE_HEADER: "{}"})
    node.handlers["/release_memory_occupation"] = release
    assert shared_lb.http.post("/release_memory_occupation", json={}).status_code == 200
    assert shared_lb.node(node.url)["routable"] is False


def test_a_pin_is_read_as_utf8(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """A version set in JSON may be any text; its pin (a header) came as UTF-8 bytes and was read as Latin-1: it
    matched no node, a 503 with Retry-After forever. Read as UTF-8 it is served; bytes that are no UTF-8 are a 400."""
    node, = module_fakes.start(1)
    node.state = {**sidecar_state(), "weight_version": "\u6b65-1"}
    set_members(shared_lb, node.url)
    shared_lb.wait_routable([node.url])
    answer = shared_lb.http.post("/generate", json={"text": "x"}, headers={"x-weight-version": "\u6b65-1".encode()})
    assert answer.status_code == 200 and answer.json()["node"] == node.url, answer.text
    assert node.requests_to("/generate")[-1].headers["x-weight-version"].encode("latin-1") == "\u6b65-1".encode()
    answer = shared_lb.http.post("/generate", json={"text": "x"}, headers={"x-weight-version": b"\xff\xfe"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert "UTF-8" in answer.json()["error"]["message"]

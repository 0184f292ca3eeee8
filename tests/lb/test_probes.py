"""What routers and SDKs probe on the LB (lb/probes.py), against fake nodes that answer, fail or misbehave."""

from __future__ import annotations

import time

import pytest

from tests.lb.behaviours import hang, reply
from tests.lb.lbproc import set_members

CARD = {"object": "list", "data": [{"id": "m", "object": "model"}]}


def test_probes_are_answered_by_a_node_whatever_its_role(module_fakes, shared_lb) -> None:
    prefill, decode = module_fakes.start(2)
    for node in (prefill, decode):
        node.handlers["/v1/models"] = reply(200, CARD)
        node.handlers["/get_server_info"] = reply(200, {"model_path": "m", "node": node.url})
        node.handlers["/health_generate"] = reply(200, {"serving": True, "success": True, "weight_version": "v3"})
    set_members(shared_lb, (prefill.url, "prefill", 9000), (decode.url, "decode"))
    shared_lb.wait_routable([prefill.url, decode.url])
    assert shared_lb.http.get("/v1/models").json() == CARD
    info = shared_lb.http.get("/get_server_info").json()
    assert info["model_path"] == "m" and info["handoff_cluster"]["total"] == 2
    assert info["handoff_cluster"]["answered_by"] == info["node"]
    health = shared_lb.http.get("/health_generate").json()
    assert health["healthy"] is True and health["weight_version"] == "v3"


def test_a_failing_node_is_skipped_and_a_misbehaving_one_named(module_fakes, shared_lb) -> None:
    broken, hanging, good = module_fakes.start(3)
    broken.handlers["/v1/models"] = reply(500, {"error": "boom"})
    hanging.handlers["/v1/models"] = hang()
    good.handlers["/v1/models"] = reply(200, CARD)
    set_members(shared_lb, broken.url, hanging.url, good.url)
    shared_lb.wait_routable([broken.url, hanging.url, good.url])
    assert shared_lb.http.get("/v1/models").json() == CARD
    good.handlers["/get_server_info"] = reply(200, b"[" * 5000 + b"]" * 5000)
    for node in (broken, hanging):
        node.handlers["/get_server_info"] = reply(502, b"")
    failed = shared_lb.http.get("/get_server_info")
    assert failed.status_code == 502 and failed.json()["error"]["type"] == "upstream_error"


def test_no_serving_node_means_503(module_fakes, shared_lb) -> None:
    released = module_fakes.start_one()
    released.set_released(True)
    set_members(shared_lb, released.url)
    shared_lb.wait_routable([released.url], expected=False)
    answer = shared_lb.http.get("/health_generate")
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node"
    assert answer.headers["retry-after"]
    released.handlers["/v1/models"] = reply(200, CARD)
    assert shared_lb.http.get("/v1/models").json() == CARD  # a released node still knows its model


def test_health_generate_passes_over_a_node_that_stopped_serving(module_fakes, shared_lb) -> None:
    """The first routable node answering that it stopped serving (released between two health checks) made the
    LB's /health_generate a 503 while another node served; it now asks the next one."""
    stopping, serving = module_fakes.start(2)
    stopping.handlers["/health_generate"] = reply(200, {"serving": False})
    serving.handlers["/health_generate"] = reply(200, {"serving": True, "weight_version": "v9"})
    set_members(shared_lb, stopping.url, serving.url)
    shared_lb.wait_routable([stopping.url, serving.url])
    for _ in range(4):  # whichever node the LB asks first
        health = shared_lb.http.get("/health_generate")
        assert health.status_code == 200, health.text
        assert health.json()["node"] == serving.url and health.json()["weight_version"] == "v9"
    serving.handlers["/health_generate"] = reply(200, {"serving": False})
    answer = shared_lb.http.get("/health_generate")
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node"
    assert stopping.url in answer.json()["error"]["message"] and answer.headers["retry-after"]


def test_a_node_without_the_endpoint_is_skipped_but_an_unknown_model_is_404(module_fakes, shared_lb) -> None:
    other_kind, handoff_node = module_fakes.start(2)
    other_kind.handlers["/get_server_info"] = reply(404, {"detail": "Not Found"})
    handoff_node.handlers["/get_server_info"] = reply(200, {"model_path": "m"})
    for node in (other_kind, handoff_node):
        node.handlers["/v1/models/nope"] = reply(404, {"error": {"type": "not_found", "message": "no"}})
    set_members(shared_lb, other_kind.url, handoff_node.url)
    shared_lb.wait_routable([other_kind.url, handoff_node.url])
    assert shared_lb.http.get("/get_server_info").json()["model_path"] == "m"
    assert shared_lb.http.get("/v1/models/nope").status_code == 404


@pytest.mark.parametrize("version", [["v1"], {"v": 1}, 7, None])
def test_a_node_reporting_an_odd_weight_version_is_shown_never_a_500(module_fakes, shared_lb, version) -> None:
    """A node's state is a peer's JSON: a weight_version that is a list or an object (unhashable) is shown as the
    node said it, and the cluster's versions disagree; /get_weight_version and /model_info still answer."""
    good, odd = module_fakes.start(2)
    odd.handlers["/memory_occupation"] = reply(200, {"serving": True, "weight_version": version})
    good.handlers["/memory_occupation"] = reply(200, {"serving": True, "weight_version": "v3"})
    set_members(shared_lb, good.url, odd.url)
    answer = shared_lb.http.get("/get_weight_version")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["consistent"] is False and body["weight_version"] is None
    assert {n["node"]: n["weight_version"] for n in body["nodes"]} == {good.url: "v3", odd.url: version}
    assert shared_lb.http.get("/memory_occupation").status_code == 200


def test_health_generate_waits_for_a_generation_not_a_health_check(module_fakes, shared_lb) -> None:
    """Found by review: each node's /health_generate was cut at --health-timeout (1 s here, 2 s by default), a
    bound for reading a node's state, not for a generation: SGLang's own /health_generate takes at least 1 s (it
    sleeps 1 s before it looks), a sidecar's queues its token behind the engine's work (up to 30 s), so a busy
    cluster was 502 "failed on every node" while it served. A node is now given a generation's time, and one
    that has not answered within --health-timeout no longer holds the next node back: both are waited for."""
    hung, busy = module_fakes.start(2)
    hung.handlers["/health_generate"] = hang()
    busy.handlers["/health_generate"] = reply(200, {"serving": True, "weight_version": "v1"}, delay=1.6)
    set_members(shared_lb, hung.url, busy.url)
    shared_lb.wait_routable([hung.url, busy.url])
    for _ in range(2):  # whichever node the LB asks first
        started = time.monotonic()
        health = shared_lb.http.get("/health_generate", timeout=20)
        assert health.status_code == 200, health.text
        assert health.json()["node"] == busy.url
        assert time.monotonic() - started < 4  # the hung node does not cost a generation's bound first

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
        # the hung node does not cost a generation's bound (30 s) first: asked first, it costs --health-timeout
        # (1 s) before the busy node's 1.6 s, 2.6 s in all, so the bound leaves room for a loaded box
        assert time.monotonic() - started < 12


GARBAGE = {
    "html": reply(200, b"<html>oops</html>", content_type="text/html"),
    "truncated": reply(200, b'{"object": "list", "data": ['),
    "not_an_object": reply(200, [1, 2]),
    "no_card_list": reply(200, {"object": "list", "data": "m"}),
    "too_deep": reply(200, b"[" * 5000 + b"]" * 5000),
    "too_large": reply(200, b" " * (2 << 20) + b"{}"),
    "empty_2xx": reply(204, b""),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_node_answering_no_model_list_is_passed_over_never_relayed(module_fakes, shared_lb, kind) -> None:
    """Found by review: the LB relayed a node's 2xx answer to /v1/models and /v1/models/{id} as it came (HTML,
    a truncated or too deep document, JSON of another shape), labelled application/json, with the node's status
    (a 204 with no body); an OpenAI SDK's models.list() then failed on it; /get_server_info was a 502 on the
    first such node while the next could answer. A node's answer is now read as JSON within bounds and as a
    model list (a card, a server info object); a node that answers otherwise is passed over for the next, and
    when none answers a 502 upstream_error names it."""
    bad, good = module_fakes.start(2)
    for path in ("/v1/models", "/v1/models/m", "/get_server_info", "/server_info"):
        bad.handlers[path] = GARBAGE[kind]
    good.handlers["/v1/models"] = reply(200, CARD)
    good.handlers["/v1/models/m"] = reply(200, CARD["data"][0])
    good.handlers["/server_info"] = good.handlers["/get_server_info"] = reply(200, {"model_path": "m"})
    set_members(shared_lb, bad.url)
    shared_lb.wait_routable([bad.url])
    infos = ("/get_server_info", "/server_info") if kind != "no_card_list" else ()  # that one is an object
    for path in ("/v1/models", "/v1/models/m", *infos):
        failed = shared_lb.http.get(path)
        assert failed.status_code == 502, (path, failed.status_code, failed.text[:200])
        assert failed.json()["error"]["type"] == "upstream_error" and bad.url in failed.text
    set_members(shared_lb, bad.url, good.url)
    shared_lb.wait_routable([bad.url, good.url])
    for _ in range(3):  # whichever node the LB asks first
        assert shared_lb.http.get("/v1/models").json() == CARD
        assert shared_lb.http.get("/v1/models/m").json() == CARD["data"][0]
        if infos:
            assert shared_lb.http.get("/server_info").json()["handoff_cluster"]["answered_by"] == good.url


def test_a_404_for_an_unknown_model_is_relayed_only_as_json(module_fakes, shared_lb) -> None:
    """A node's 404 to /v1/models/{id} is relayed only when it is JSON: one that answers HTML is passed over."""
    html, node = module_fakes.start(2)
    html.handlers["/v1/models/nope"] = reply(404, b"<html>Not Found</html>", content_type="text/html")
    node.handlers["/v1/models/nope"] = reply(404, {"error": {"type": "invalid_request_error", "message": "no"}})
    set_members(shared_lb, html.url)
    shared_lb.wait_routable([html.url])
    assert shared_lb.http.get("/v1/models/nope").status_code == 502
    set_members(shared_lb, html.url, node.url)
    shared_lb.wait_routable([html.url, node.url])
    for _ in range(3):
        missing = shared_lb.http.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["message"] == "no"


def test_model_info_failing_on_every_node_names_each_node(module_fakes, shared_lb) -> None:
    """Found by review: /model_info asked its nodes with a loop of its own, and when none answered it was a 503
    no_available_node naming only the last node's error (the first node's failure was lost). It is now asked
    as the other probes are (lb/probes.py): a 502 upstream_error with every node's failure in ``failures``."""
    broken, odd = module_fakes.start(2)
    broken.handlers["/model_info"] = reply(500, {"error": "boom"})
    odd.handlers["/model_info"] = reply(200, [1, 2])  # JSON, but no object
    set_members(shared_lb, broken.url, odd.url)
    shared_lb.wait_routable([broken.url, odd.url])
    for path in ("/model_info", "/get_model_info"):
        failed = shared_lb.http.get(path)
        assert failed.status_code == 502, (path, failed.status_code, failed.text)
        error = failed.json()["error"]
        assert error["type"] == "upstream_error", error
        by_node = {failure["node"]: failure for failure in error["failures"]}
        assert by_node[broken.url] == {"node": broken.url, "status": 500}, error
        assert "not an object" in by_node[odd.url]["error"], error


def test_model_info_skips_a_hung_node_for_a_healthy_one(module_fakes, shared_lb) -> None:
    """A node that never answers /model_info costs --health-timeout (1 s here) at most, then the next node
    answers (asked as every probe path is, lb/probes.py); its answer carries the cluster's weight version."""
    hung, good = module_fakes.start(2)
    hung.handlers["/model_info"] = hang()
    good.handlers["/model_info"] = reply(200, {"model_path": "m", "node": good.url})
    for node in (hung, good):
        node.state["weight_version"] = "v5"
    set_members(shared_lb, hung.url, good.url)
    shared_lb.wait_routable([hung.url, good.url])
    started = time.monotonic()
    info = shared_lb.http.get("/model_info", timeout=20)
    assert info.status_code == 200, info.text
    body = info.json()
    assert body["node"] == good.url and body["model_path"] == "m" and body["weight_version"] == "v5", body
    assert body["weight_versions"]["consistent"] is True, body
    assert time.monotonic() - started < 10  # 1 s for the hung node, then the good one: room for a loaded box

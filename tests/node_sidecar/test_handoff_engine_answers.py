"""A real sidecar in front of a handoff engine that answers its control calls with a 2xx that says something else
(review, stop 32): an engine of another version, or a broken one. Each such answer is one clear 502
``upstream_error`` for that call, and the sidecar records no state the engine did not reach.

The engine is a fake (``tests/lb/fakes.py``) that reports the engine's ``/memory_occupation`` and answers each
control call as the test scripts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(60)

TAGS = ("weights", "kv_cache", "cuda_graph", "workspace")


def engine_state(**fields: Any) -> dict[str, Any]:
    """The handoff engine's ``GET /memory_occupation``, every tag resident."""
    return {"tags": {tag: {"state": "resident", "bytes": 1000} for tag in TAGS}, "weights_valid": True,
            "weight_version": "v1", "memory_saver": "cpu", "weights_backup": "cpu", "paused": False,
            "control_calls_pending": 0, **fields}


def answering(body: Any, status: int = 200) -> Any:
    async def handler(_: FakeNode, ex: Exchange) -> None:
        ex.respond(status, json.dumps(body).encode())
    return handler


class Node:
    def __init__(self, engine: FakeNode, sidecar: ServerProcess) -> None:
        self.engine = engine
        self.sidecar = sidecar

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(self.sidecar.url + path, json={} if body is None else body, timeout=30)

    def view(self) -> dict[str, Any]:
        return httpx.get(self.sidecar.url + "/memory_occupation", timeout=10).json()

    def states(self) -> dict[str, str]:
        return {tag: row["state"] for tag, row in self.view()["tags"].items()}


@pytest.fixture
def node(proc_log_dir: Path) -> Iterator[Node]:
    with FakeCluster() as fakes:
        engine = fakes.start_one()
        engine.state = engine_state()
        sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-kind", "handoff",
                                                 "--engine-poll-interval", "0.2"],
                                log_dir=proc_log_dir, name="sidecar-handoff-answers").start()
        try:
            wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="ready")
            yield Node(engine, sidecar)
        finally:
            sidecar.stop()


def assert_upstream_error(answer: httpx.Response) -> None:
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["type"] == "upstream_error", answer.text


@pytest.mark.parametrize("body", [
    {"success": True, "released": [], "bytes_freed": {}},      # released nothing it was asked to
    {"success": True},                                         # says nothing of what it released
    {"success": False, "released": list(TAGS)},                # not a success
    {"success": True, "released": 7},                          # not a list (was a 500)
    {"success": True, "released": list(TAGS), "bytes_freed": [1, 2]},  # not an object (was a 500)
    {"success": True, "released": list(TAGS), "bytes_freed": {"weights": "lots"}},
    [1, 2],                                                    # not an object
])
def test_a_release_the_engine_does_not_confirm_is_a_502_and_nothing_is_recorded(node: Node, body: Any) -> None:
    node.engine.handlers["/release_memory_occupation"] = answering(body)
    answer = node.post("/release_memory_occupation")
    assert_upstream_error(answer)
    assert node.states() == dict.fromkeys(TAGS, "resident")  # as the engine still has them
    wait_until(lambda: httpx.get(node.sidecar.url + "/ready").status_code == 200, timeout=10, what="serving")


@pytest.mark.parametrize("body", [
    {"success": True, "resumed": [], "bytes_restored": {}, "weights_valid": True},
    {"success": True, "resumed": list(TAGS), "bytes_restored": {}, "weights_valid": "false"},
    {"success": "yes", "resumed": list(TAGS), "bytes_restored": {}, "weights_valid": True},
])
def test_a_resume_the_engine_does_not_confirm_is_a_502_and_nothing_is_recorded(node: Node, body: Any) -> None:
    node.engine.state = engine_state(tags={tag: {"state": "released", "bytes": 0} for tag in TAGS})
    node.engine.handlers["/release_memory_occupation"] = answering(
        {"success": True, "released": list(TAGS), "already_released": [], "bytes_freed": dict.fromkeys(TAGS, 1000)})
    assert node.post("/release_memory_occupation").status_code == 200
    assert node.states() == dict.fromkeys(TAGS, "released")
    node.engine.handlers["/resume_memory_occupation"] = answering(body)
    assert_upstream_error(node.post("/resume_memory_occupation"))
    assert node.states() == dict.fromkeys(TAGS, "released") and node.view()["serving"] is False


@pytest.mark.parametrize("fields", [
    {"weights_valid": "false"},                                                    # a string is not a bool
    {"tags": {tag: {"state": "releasing", "bytes": 0} for tag in TAGS}},           # the sidecar's own state
    {"tags": {tag: {"state": "resident", "bytes": True} for tag in TAGS}},
    {"tags": {tag: {"state": "resident", "bytes": -5} for tag in TAGS}},
])
def test_an_engine_view_the_sidecar_cannot_read_is_not_adopted(node: Node, fields: dict[str, Any]) -> None:
    """A view read again after an outage: one with a field the sidecar cannot take is no view (not serving,
    ``last_error`` says why), never adopted as the node's state."""
    node.engine.state = engine_state(**fields)
    node.engine.handlers["/health"] = answering({"status": "starting"}, 503)
    wait_until(lambda: node.view()["engine_reachable"] is False, timeout=10, what="engine marked down")
    node.engine.handlers["/health"] = answering({"status": "ok"})
    wait_until(lambda: "memory_occupation" in (node.view()["last_error"] or ""), timeout=10, what="read refused")
    view = node.view()
    assert view["serving"] is False and set(node.states().values()) == {"unknown"}, view


@pytest.mark.parametrize("body", [{"success": False}, {}, "ok"])
def test_a_pause_the_engine_does_not_confirm_is_a_502_and_the_node_is_not_paused(node: Node, body: Any) -> None:
    node.engine.handlers["/pause_generation"] = answering(body)
    assert_upstream_error(node.post("/pause_generation", {"mode": "retract"}))
    assert node.view()["paused"] is False


def test_a_continue_the_engine_does_not_confirm_is_a_502_and_the_node_stays_paused(node: Node) -> None:
    assert node.post("/pause_generation", {"mode": "retract"}).status_code == 200
    node.engine.handlers["/continue_generation"] = answering({"success": False})
    assert_upstream_error(node.post("/continue_generation"))
    assert node.view()["paused"] is True


@pytest.mark.parametrize("body", [{"success": False, "message": "could not load"}, {}, {"weights_valid": True},
                                  {"success": True, "weights_valid": "false"},
                                  {"success": True, "weights_valid": True, "weights_updated_fully": "yes"}])
def test_a_reload_the_engine_does_not_confirm_is_a_502_and_the_weights_stay_invalid(node: Node, body: Any) -> None:
    node.engine.state = engine_state(weights_valid=False)
    node.engine.handlers["/health"] = answering({"status": "starting"}, 503)
    wait_until(lambda: node.view()["engine_reachable"] is False, timeout=10, what="engine marked down")
    node.engine.handlers["/health"] = answering({"status": "ok"})
    wait_until(lambda: node.view()["engine_reachable"] is True, timeout=10, what="engine read again")
    assert node.view()["weights_valid"] is False

    async def reload(_: FakeNode, ex: Exchange) -> None:
        dry = ex.request.json().get("dry_run") is True
        ex.respond(200, json.dumps({"success": True, "dry_run": True} if dry else body).encode())
    node.engine.handlers["/update_weights_from_disk"] = reload
    assert_upstream_error(node.post("/update_weights_from_disk", {"model_path": "/ckpt"}))
    assert node.view()["weights_valid"] is False and node.view()["serving"] is False


def test_a_failed_release_whose_state_cannot_be_read_again_is_not_reported_resident(node: Node) -> None:
    """A release the engine did but answered with something else (502), its view then unreadable too (an engine of
    another version): the sidecar kept the tags as it had them, resident, and served, while the engine held them
    released; the monitor never read the view again. Now the state is unknown and nothing is served until the view
    is read, and then it is the engine's."""
    node.engine.handlers["/release_memory_occupation"] = answering({"success": True})
    node.engine.state = engine_state(weights_valid="no", tags={tag: {"state": "released", "bytes": 0} for tag in TAGS})
    assert_upstream_error(node.post("/release_memory_occupation"))
    view = node.view()
    assert view["serving"] is False and set(node.states().values()) == {"unknown"}, view
    assert httpx.get(node.sidecar.url + "/ready").status_code == 503
    refused = httpx.post(node.sidecar.url + "/generate", json={"text": "x"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_unavailable", refused.text
    node.engine.state = engine_state(tags={tag: {"state": "released", "bytes": 0} for tag in TAGS})
    wait_until(lambda: node.states() == dict.fromkeys(TAGS, "released"), timeout=10, what="the view read again")
    assert node.view()["serving"] is False


@pytest.mark.parametrize(("path", "body"), [
    ("/flush_cache", None), ("/update_weight_version", {"new_version": "v2"}), ("/abort_request", {"abort_all": True}),
    ("/update_weights_from_disk", {"model_path": "/ckpt", "dry_run": True})])
def test_other_calls_the_engine_does_not_confirm_are_a_502(node: Node, path: str, body: Any) -> None:
    node.engine.handlers[path] = answering({"success": False, "message": "no", "new_version": "v2"})
    assert_upstream_error(node.post(path, body))
    assert node.view()["weight_version"] == "v1" and node.view()["serving"] is True


@pytest.mark.parametrize("odd", [True, -5, int("9" * 4300)])
def test_odd_byte_counts_of_a_synced_engine_are_not_shown(node: Node, odd: Any) -> None:
    """The view's per-tag bytes come fresh from the engine at each ``GET /memory_occupation``: any integer was
    shown (``true``, ``-5``, a 4,300-digit one), where reading the engine's view refuses them."""
    node.engine.state = engine_state(tags={tag: {"state": "resident", "bytes": odd} for tag in TAGS})
    assert {tag: row["bytes"] for tag, row in node.view()["tags"].items()} == dict.fromkeys(TAGS, 1000)

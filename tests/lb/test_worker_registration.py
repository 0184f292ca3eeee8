"""Worker registration as RL frameworks do it against sglang-router 0.3.x, and the weight-version views an RL
loop reads through the LB (real LB processes, fake nodes)."""

from __future__ import annotations

import pytest

from tests.lb.behaviours import reply
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


def test_a_plain_sglang_nodes_weight_version_is_what_the_lb_reports(module_fakes: FakeCluster,
                                                                    shared_lb: LB) -> None:
    """SGLang 0.5.23 tells its version in /model_info (it has no /get_weight_version); through the LB the
    version must be the node's, not null, and a request pinned to it must reach it."""
    plain = module_fakes.start_one(is_sidecar=False)
    plain.handlers["/model_info"] = reply(200, {"model_path": "m", "weight_version": "step-3"})
    set_members(shared_lb, plain.url)
    shared_lb.wait_routable([plain.url])
    info = shared_lb.http.get("/model_info")
    assert info.status_code == 200 and info.json()["weight_version"] == "step-3", info.text
    versions = shared_lb.http.get("/get_weight_version").json()
    assert versions["weight_version"] == "step-3" and versions["consistent"] is True, versions
    assert shared_lb.http.get("/memory_occupation").json()["weight_versions"] == {"step-3": 1}
    pinned = shared_lb.http.post("/generate", json={"text": "hi"}, headers={"X-Weight-Version": "step-3"})
    assert pinned.status_code == 200 and pinned.json()["node"] == plain.url, pinned.text


def test_a_node_that_is_down_does_not_make_the_versions_disagree(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """GET /memory_occupation counts only the nodes that answered; GET /get_weight_version must not take the
    version a node that is down reported before it went down for what it serves now."""
    up, down = module_fakes.start(2)
    for node in (up, down):
        node.state["weight_version"] = "step-1"
    set_members(shared_lb, up.url, down.url)
    shared_lb.wait_routable([up.url, down.url])
    down.stop()
    up.state["weight_version"] = "step-2"
    wait_until(lambda: shared_lb.node(down.url)["health"] == "unhealthy", timeout=10, what="the node down")
    assert shared_lb.http.get("/memory_occupation").json()["weight_versions"] == {"step-2": 1}
    versions = shared_lb.http.get("/get_weight_version").json()
    assert versions["weight_version"] == "step-2" and versions["consistent"] is True, versions
    by_node = {entry["node"]: entry for entry in versions["nodes"]}
    assert by_node[down.url]["weight_version"] is None and by_node[down.url]["health"] == "unhealthy"
    assert by_node[up.url]["weight_version"] == "step-2" and by_node[up.url]["health"] == "healthy"


@pytest.mark.parametrize("spelling", ["http://LOCALHOST:{port}", "http://[0:0:0:0:0:0:0:1]:{port}",
                                      "http://127.0.0.1:{port}/"])
def test_slime_finds_its_worker_by_the_url_it_registered(module_fakes: FakeCluster, shared_lb: LB,
                                                         spelling: str) -> None:
    """slime (router >= 0.3) registers ``POST /workers {"url": U}`` and at shutdown looks U up in
    ``GET /workers`` by ``worker["url"] == U`` to delete it by id; sglang-router lists U as it was given."""
    node = module_fakes.start_one(host="::1" if "[" in spelling else "127.0.0.1")
    set_members(shared_lb)
    url = spelling.format(port=node.port)
    added = shared_lb.http.post("/workers", json={"url": url, "worker_type": "regular"})
    assert added.status_code == 200 and added.json()["worker"]["url"] == url, added.text
    workers = shared_lb.http.get("/workers").json()["workers"]
    mine = [worker for worker in workers if worker["url"] == url]
    assert len(mine) == 1, workers
    assert shared_lb.http.delete(f"/workers/{mine[0]['id']}").status_code == 200
    assert shared_lb.nodes() == []


def test_the_fields_sglang_routers_worker_request_takes_are_accepted(module_fakes: FakeCluster,
                                                                     shared_lb: LB) -> None:
    """sglang-router 0.3.2 answers 202 to a POST /workers carrying any of its WorkerConfigRequest's fields;
    the LB takes them too (they mean nothing to it) and still refuses a field no router knows (a typo)."""
    node = module_fakes.start_one()
    set_members(shared_lb)
    body = {"url": node.url, "worker_type": "regular", "api_key": "k", "model_id": "m", "priority": 50,
            "cost": 1.0, "runtime": "sglang", "labels": {"zone": "a"}, "disable_health_check": False,
            "health_check_timeout_secs": 30, "dp_aware": False}
    added = shared_lb.http.post("/workers", json=body)
    assert added.status_code == 200 and added.json()["worker"]["url"] == node.url, added.text
    typo = shared_lb.http.post("/workers", json={"url": node.url, "wroker_type": "decode"})
    assert typo.status_code == 400 and "wroker_type" in typo.json()["error"]["message"], typo.text


@pytest.mark.parametrize("pin", ["", "v" * 1025])
def test_a_pin_no_node_could_ever_serve_is_refused_not_retried(module_fakes: FakeCluster, shared_lb: LB,
                                                                pin: str) -> None:
    """A version is 1 to 1024 characters wherever it is set; a request pinned to anything else can never be
    served, so a 503 with Retry-After (an invitation to retry for ever) is the wrong answer: 400 names it."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    shared_lb.wait_routable([node.url])
    answer = shared_lb.http.post("/generate", json={"text": "hi"}, headers={"X-Weight-Version": pin})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert "retry-after" not in answer.headers
    assert node.requests_to("/generate") == []


def test_an_unknown_worker_id_is_a_404_that_does_not_send_it_back_whole(module_fakes: FakeCluster,
                                                                         shared_lb: LB) -> None:
    set_members(shared_lb)
    answer = shared_lb.http.delete("/workers/" + "w" * 20_000)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "node_not_found", answer.text[:300]
    assert len(answer.content) < 1000


def test_a_worker_is_read_by_the_id_the_add_answered(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """sglang-router 0.3.x answers ``POST /workers`` with ``worker_id`` and ``location`` (``/workers/{id}``) and
    serves ``GET /workers/{id}`` (404 for an id it does not know); a client written for it reads the id from the
    add's answer, not from a listing, and deletes the worker by it."""
    node = module_fakes.start_one()
    set_members(shared_lb)
    added = shared_lb.http.post("/workers", json={"url": node.url}).json()
    assert added["url"] == node.url and added["location"] == f"/workers/{added['worker_id']}", added
    read = shared_lb.http.get(added["location"])
    assert read.status_code == 200 and read.json()["url"] == node.url, read.text
    assert read.json()["id"] == added["worker_id"] == shared_lb.http.get("/workers").json()["workers"][0]["id"]
    removed = shared_lb.http.delete(added["location"])
    assert removed.status_code == 200 and removed.json()["worker_id"] == added["worker_id"], removed.text
    gone = shared_lb.http.get(added["location"])
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "node_not_found", gone.text

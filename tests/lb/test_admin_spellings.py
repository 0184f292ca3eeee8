"""Admin calls that name a node, under any spelling, and the parameters a fan-out takes: each acts on exactly
the node it names or is refused and changes nothing (real LB processes, fake nodes)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.lb.behaviours import hang, reply
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)

RELEASE = "/release_memory_occupation"


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


def test_a_flag_node_named_by_host_name_is_one_node_with_its_address(fakes: FakeCluster, start_lb,
                                                                    tmp_path: Path) -> None:
    node = fakes.start_one(host="127.0.0.1")
    port = port_of(node.url)
    answers = tmp_path / "dns.json"
    answers.write_text(json.dumps({"vm.test": ["127.0.0.1"], "nodes.test": ["127.0.0.1"]}))
    lb = start_lb("--node", node.url, "--node", f"http://vm.test:{port}", "--discover-dns",
                  f"mixed=nodes.test:{port}", "--discover-interval", "0.2", module="tests.lb.dns_lb",
                  env={"HANDOFF_TEST_DNS_FILE": str(answers)})
    assert [n["url"] for n in lb.nodes()] == [node.url]  # the second flag and the DNS answer are the same node
    assert f"one node, kept as {node.url}" in lb.log()
    again = lb.http.post("/nodes", json={"url": f"http://VM.test:{port}"})
    assert again.status_code == 409 and again.json()["error"]["node"] == node.url, again.text
    before = len(node.requests_to("/flush_cache"))
    assert lb.http.post("/flush_cache").json()["total"] == 1
    assert len(node.requests_to("/flush_cache")) == before + 1


@pytest.mark.parametrize("query", ["node=http://127.0.0.1:1", "rol=decode", "timeout=5&extra=1"])
def test_a_fan_out_refuses_a_parameter_it_does_not_take(module_fakes: FakeCluster, shared_lb: LB,
                                                        query: str) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post(f"{RELEASE}?{query}", json={})
    assert answer.status_code == 400 and "unknown query parameter" in answer.json()["error"]["message"], answer.text
    assert node.requests_to(RELEASE) == []  # nothing was released


def test_a_tensor_push_names_its_nodes_under_any_spelling(module_fakes: FakeCluster, shared_lb: LB) -> None:
    first, second = module_fakes.start(2)
    first.handlers["/update_weights_from_tensor"] = reply(200, {"success": True})
    set_members(shared_lb, first.url, second.url)
    port = port_of(first.url)
    answer = shared_lb.http.post("/update_weights_from_tensor",
                                 params=[("node", first.url), ("node", first.url + "/"),
                                         ("node", f"http://localhost:{port}")],
                                 json={"serialized_named_tensors": ["x"]})
    assert answer.status_code == 200 and answer.json()["total"] == 1, answer.text
    assert len(first.requests_to("/update_weights_from_tensor")) == 1
    assert second.requests_to("/update_weights_from_tensor") == []
    refused = shared_lb.http.post("/update_weights_from_tensor?role=decode", json={"serialized_named_tensors": []})
    assert refused.status_code == 400 and "'role'" in refused.json()["error"]["message"]


def test_the_worker_api_finds_a_member_under_another_spelling(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    other = f"http://localhost:{port_of(node.url)}"
    added = shared_lb.http.post("/add_worker", params={"url": other})
    assert added.status_code == 200 and added.text == f"Worker already added: {node.url}"
    removed = shared_lb.http.post("/remove_worker", params={"url": other})
    assert removed.status_code == 200 and removed.text == f"Successfully removed worker: {node.url}"
    assert shared_lb.nodes() == []
    set_members(shared_lb, node.url)
    gone = shared_lb.http.delete("/nodes", params={"url": other})
    assert gone.status_code == 200 and gone.json()["removed"]["url"] == node.url


def test_registering_a_prefill_worker_with_another_bootstrap_port_is_refused(module_fakes: FakeCluster,
                                                                            shared_lb: LB) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb, (node.url, "prefill", 8998))
    body = {"url": node.url, "worker_type": "prefill", "bootstrap_port": 9000}
    answer = shared_lb.http.post("/workers", json=body)
    assert answer.status_code == 409 and "bootstrap port 8998" in answer.json()["error"]["message"], answer.text
    assert shared_lb.node(node.url)["bootstrap_port"] == 8998
    same = shared_lb.http.post("/workers", json={**body, "bootstrap_port": 8998})
    assert same.status_code == 200 and "already added" in same.json()["message"]


@pytest.mark.parametrize(("path", "body"), [
    ("/nodes", {"url": "URL", "role": "prefill", "bootstrap_port": True}),
    ("/nodes", {"url": "URL", "role": "prefill", "bootstrap_port": "9000"}),
    ("/workers", {"url": "URL", "worker_type": "prefill", "bootstrap_port": 9000.0}),
])
def test_membership_bodies_take_only_their_types(module_fakes: FakeCluster, shared_lb: LB, path: str,
                                                 body: dict[str, object]) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb)
    answer = shared_lb.http.post(path, json={**body, "url": node.url})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert shared_lb.nodes() == []


def test_an_escaped_drain_timeout_is_checked_too(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post(f"{RELEASE}?timeout=2", content=b'{"drain\\u005ftimeout": 30}',
                                 headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "drain_timeout" in answer.json()["error"]["message"], answer.text
    assert node.requests_to(RELEASE) == []


def test_a_node_removed_during_its_first_check_is_not_reported_added(module_fakes: FakeCluster,
                                                                     shared_lb: LB) -> None:
    node = module_fakes.start_one()
    node.handlers["/memory_occupation"] = hang()  # the first check waits out --health-timeout (1 s)
    set_members(shared_lb)
    with ThreadPoolExecutor(1) as pool:
        adding = pool.submit(shared_lb.http.post, "/nodes", json={"url": node.url})
        wait_until(lambda: [n["url"] for n in shared_lb.nodes()] == [node.url], timeout=5, what="the node listed")
        assert shared_lb.http.delete("/nodes", params={"url": node.url}).status_code == 200
        answer = adding.result(timeout=10)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "node_not_found", answer.text
    assert "removed while its first check ran" in answer.json()["error"]["message"]
    assert shared_lb.nodes() == []


def test_admin_calls_check_the_token_before_reading_the_body(fakes: FakeCluster, start_lb) -> None:
    lb = start_lb("--admin-token", "admin-s3cret")
    answer = lb.http.post("/nodes", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "unauthorized", answer.text


def test_an_address_a_name_no_longer_has_never_names_a_member(fakes: FakeCluster, start_lb, tmp_path: Path) -> None:
    """A named flag node moves (Kubernetes reuses pod IPs): another node on its old address is another node, and
    a DELETE of that address removes nothing."""
    moved = fakes.start_one(host="127.0.0.2")
    other = fakes.start_one(host="127.0.0.1", port=int(port_of(moved.url)))
    port = port_of(moved.url)
    answers = tmp_path / "dns.json"
    answers.write_text(json.dumps({"vm.test": ["127.0.0.1"]}))
    lb = start_lb("--node", f"http://vm.test:{port}", module="tests.lb.dns_lb",
                  env={"HANDOFF_TEST_DNS_FILE": str(answers)})
    answers.write_text(json.dumps({"vm.test": ["127.0.0.2"]}))  # the name moved after the LB learned it
    gone = lb.http.delete("/nodes", params={"url": other.url})
    assert gone.status_code == 404 and [n["url"] for n in lb.nodes()] == [f"http://vm.test:{port}"], gone.text
    added = lb.http.post("/nodes", json={"url": other.url})
    assert added.status_code == 201, added.text
    assert sorted(n["url"] for n in lb.nodes()) == sorted([f"http://vm.test:{port}", other.url])


def test_a_worker_listed_under_an_address_its_name_has_is_removed_by_that_url(fakes: FakeCluster, start_lb,
                                                                               tmp_path: Path) -> None:
    """A member named ``vm.test`` registered again as ``127.0.0.1`` (what the name resolves to) is listed by
    ``GET /list_workers`` as ``127.0.0.1``; ``POST /remove_worker`` and ``DELETE /workers/{url}`` with that very
    URL must remove it, not answer "not registered" and leave it serving (a legacy RL loop's round trip)."""
    node = fakes.start_one(host="127.0.0.1")
    port = port_of(node.url)
    answers = tmp_path / "dns.json"
    answers.write_text(json.dumps({"vm.test": ["127.0.0.1"]}))
    lb = start_lb(module="tests.lb.dns_lb", env={"HANDOFF_TEST_DNS_FILE": str(answers)})
    named = f"http://vm.test:{port}"
    for first, then in ((named, node.url), (node.url, named)):  # and the other way round
        for remove in (lambda url: lb.http.post("/remove_worker", params={"url": url}),
                       lambda url: lb.http.delete("/workers/" + url)):
            assert lb.http.post("/add_worker", params={"url": first}).status_code == 200
            again = lb.http.post("/add_worker", params={"url": then})
            assert again.status_code == 200 and again.text == f"Worker already added: {first}", again.text
            assert lb.http.get("/list_workers").json()["urls"] == [then]
            removed = remove(then)
            assert removed.status_code == 200 and first in removed.text, removed.text
            assert lb.nodes() == [] and lb.http.get("/list_workers").json()["urls"] == []

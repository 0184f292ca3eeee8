"""The membership changing while calls are under way (real LB processes, fake nodes): a weight group keeps the
nodes that joined it, and a name that moves onto a discovered address is one member."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.lb.lbproc import node_args
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)

INIT = "/init_weights_update_group"
UPDATE = "/update_weights_from_distributed"
DESTROY = "/destroy_weights_update_group"
GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
BROADCAST = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}


def keeps_groups(node: FakeNode) -> set[str]:
    """Make ``node`` hold weight groups as an engine does: joined by an init, needed by an update, left by a
    destroy (400 for a group it does not hold). Returns the names it holds, as they change."""
    joined: set[str] = set()

    def name_of(ex: Exchange) -> str:
        body: dict[str, Any] = ex.request.json() if ex.request.body else {}
        return body.get("group_name", "weight_update_group")

    async def init(node: FakeNode, ex: Exchange) -> None:
        joined.add(name_of(ex))
        ex.respond(200, {"success": True, "rank": ex.request.json()["rank_offset"]})

    async def needs_group(node: FakeNode, ex: Exchange) -> None:
        name = name_of(ex)
        if name not in joined:
            ex.respond(400, {"error": {"type": "invalid_request", "message": f"group {name!r} does not exist"}})
            return
        if ex.request.path == DESTROY:
            joined.discard(name)
        ex.respond(200, {"success": True})

    node.handlers.update({INIT: init, UPDATE: needs_group, DESTROY: needs_group})
    return joined


def test_a_weight_group_keeps_its_nodes_while_the_membership_changes(fakes: FakeCluster, start_lb) -> None:
    first, second, later = fakes.start(3)
    groups = {node.url: keeps_groups(node) for node in (first, second, later)}
    lb = start_lb(*node_args(first.url, second.url))
    joined = lb.http.post(INIT, json=GROUP)
    assert joined.status_code == 200, joined.text
    assert {r["node"]: r["rank_offset"] for r in joined.json()["results"]} == {first.url: 1, second.url: 2}
    # during the group's life one node joins the LB and one leaves it: the group is still the trainer and the two
    # engines that joined it (the broadcasts need both; the newcomer holds no rank)
    assert lb.http.post("/nodes", json={"url": later.url}).status_code == 201
    assert lb.http.delete("/nodes", params={"url": second.url}).status_code == 200
    update = lb.http.post(UPDATE, json=BROADCAST)
    assert update.status_code == 200, update.text
    assert sorted(r["node"] for r in update.json()["results"]) == sorted([first.url, second.url])
    assert later.requests_to(UPDATE) == [] and len(second.requests_to(UPDATE)) == 1
    # the node that left comes back under its URL (an engine registered again): one node of the group, not two
    assert lb.http.post("/nodes", json={"url": second.url}).status_code == 201
    left = lb.http.post(DESTROY, json={})
    assert left.status_code == 200, left.text
    assert sorted(r["node"] for r in left.json()["results"]) == sorted([first.url, second.url])
    assert groups == {first.url: set(), second.url: set(), later.url: set()}  # nobody is left in the group
    assert later.requests_to(DESTROY) == []
    # the next group is formed over the members of now
    again = lb.http.post(INIT, json={**GROUP, "world_size": 4})
    assert again.status_code == 200, again.text
    assert {r["node"]: r["rank_offset"] for r in again.json()["results"]} == {first.url: 1, later.url: 2,
                                                                              second.url: 3}
    assert lb.http.post(DESTROY, json={}).status_code == 200
    assert groups == {first.url: set(), second.url: set(), later.url: set()}


def test_groups_of_one_name_for_two_roles_keep_both_sets_of_nodes(fakes: FakeCluster, start_lb) -> None:
    """Two inits of one group name, one per ``?role=``, each with its own trainer: the second init used to
    replace the first one's nodes, so the prefill nodes' update went nowhere (503) and their group was never
    destroyed."""
    prefill, decode = fakes.start(2)
    groups = {node.url: keeps_groups(node) for node in (prefill, decode)}
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url)
    one = {**GROUP, "world_size": 2, "group_name": "g"}
    for role in ("prefill", "decode"):
        joined = lb.http.post(INIT, params={"role": role}, json=one)
        assert joined.status_code == 200, joined.text
    assert groups == {prefill.url: {"g"}, decode.url: {"g"}}
    for role, node in (("prefill", prefill), ("decode", decode)):
        update = lb.http.post(UPDATE, params={"role": role}, json={**BROADCAST, "group_name": "g"})
        assert update.status_code == 200, update.text
        assert [r["node"] for r in update.json()["results"]] == [node.url]
    both = lb.http.post(UPDATE, json={**BROADCAST, "group_name": "g"})
    assert both.status_code == 200 and len(both.json()["results"]) == 2, both.text
    left = lb.http.post(DESTROY, params={"role": "prefill"}, json={"group_name": "g"})
    assert left.status_code == 200 and [r["node"] for r in left.json()["results"]] == [prefill.url], left.text
    assert groups == {prefill.url: set(), decode.url: {"g"}}
    rest = lb.http.post(DESTROY, json={"group_name": "g"})
    assert rest.status_code == 200 and [r["node"] for r in rest.json()["results"]] == [decode.url], rest.text
    assert groups == {prefill.url: set(), decode.url: set()}


def test_a_destroy_that_failed_on_a_node_goes_to_it_again(fakes: FakeCluster, start_lb) -> None:
    first, second = fakes.start(2)
    groups = {node.url: keeps_groups(node) for node in (first, second)}
    lb = start_lb(*node_args(first.url, second.url))
    assert lb.http.post(INIT, json=GROUP).status_code == 200
    assert lb.http.delete("/nodes", params={"url": second.url}).status_code == 200
    destroy = second.handlers[DESTROY]

    async def unavailable(node: FakeNode, ex: Exchange) -> None:
        ex.respond(503, {"error": {"type": "engine_unavailable", "message": "engine restarting"}})

    second.handlers[DESTROY] = unavailable
    failed = lb.http.post(DESTROY, json={})
    assert failed.status_code == 502 and [f["node"] for f in failed.json()["failures"]] == [second.url], failed.text
    second.handlers[DESTROY] = destroy
    retried = lb.http.post(DESTROY, json={})
    assert retried.status_code == 200 and [r["node"] for r in retried.json()["results"]] == [second.url], retried.text
    assert groups == {first.url: set(), second.url: set()}


def test_a_name_that_moves_onto_a_discovered_address_is_one_member(fakes: FakeCluster, start_lb,
                                                                   tmp_path: Path) -> None:
    """Kubernetes reuses pod IPs: a flag node named by host name that restarts on the address of a node DNS
    discovery added is that node, not a second member (every control call twice, two ranks in a group)."""
    first = fakes.start_one(host="127.0.0.1")
    second = fakes.start_one(host="127.0.0.2", port=first.port)
    named = f"http://vm.test:{first.port}"
    answers = tmp_path / "dns.json"

    def publish(hosts: dict[str, list[str]]) -> None:
        tmp = answers.with_suffix(".tmp")
        tmp.write_text(json.dumps(hosts))
        tmp.replace(answers)

    publish({"vm.test": ["127.0.0.2"], "nodes.test": ["127.0.0.1"]})
    lb = start_lb("--node", named, "--discover-dns", f"mixed=nodes.test:{first.port}", "--discover-interval", "0.2",
                  module="tests.lb.dns_lb", env={"HANDOFF_TEST_DNS_FILE": str(answers)})

    def members() -> list[str]:
        return sorted(n["url"] for n in lb.nodes())

    assert members() == sorted([named, first.url])
    publish({"vm.test": ["127.0.0.1"], "nodes.test": ["127.0.0.1", "127.0.0.2"]})  # the two swapped addresses
    wait_until(lambda: second.url in members(), timeout=10, what="the discovered address the name left added")
    assert members() == sorted([named, second.url])
    assert f"removed ['{first.url}']" in lb.log()

"""The membership changing while calls are under way (real LB processes, fake nodes): a weight group keeps the
nodes that joined it, and a name that moves onto a discovered address is one member."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import pytest

from tests.lb.behaviours import Gate, reply
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


def test_an_engine_back_at_another_tp_size_gets_as_many_ranks_as_it_has_now(fakes: FakeCluster, start_lb) -> None:
    """The ranks of a node are its ``tp_size`` now (SGLang's rank is ``rank_offset + tp_rank``): an engine
    restarted at TP 2 since the LB's last check got one rank, the next node the rank of its second TP rank, and a
    ``world_size`` one short was taken (the group's rendezvous then waits for a rank nobody has)."""
    first, second = fakes.start(2)
    groups = {node.url: keeps_groups(node) for node in (first, second)}
    lb = start_lb(*node_args(first.url, second.url), "--health-interval", "60", fast_health=False)
    wait_until(lambda: all(n["health"] == "healthy" for n in lb.nodes()), timeout=10, what="the first checks")
    first.state = {**first.state, "tp_size": 2}  # its engine restarted with --tp-size 2
    short = lb.http.post(INIT, json=GROUP)
    assert short.status_code == 400 and short.json()["error"]["world_size"] == 4, short.text
    assert short.json()["error"]["rank_offsets"] == {first.url: 1, second.url: 3}
    assert first.requests_to(INIT) == [] and second.requests_to(INIT) == []
    joined = lb.http.post(INIT, json={**GROUP, "world_size": 4})
    assert joined.status_code == 200, joined.text
    assert {r["node"]: r["rank_offset"] for r in joined.json()["results"]} == {first.url: 1, second.url: 3}
    assert groups == {first.url: {"weight_update_group"}, second.url: {"weight_update_group"}}


def test_a_plain_sglang_server_gets_a_rank_per_tp_rank(fakes: FakeCluster, start_lb) -> None:
    """A plain SGLang server (no sidecar) at ``--tp-size 2`` was counted as one rank: the next node got the rank of
    its second TP rank. Its ``tp_size`` is read from its server info (``/get_server_info`` where there is no
    ``/server_info``)."""
    plain, after, older = fakes.start(3, is_sidecar=False)
    plain.handlers["/server_info"] = reply(200, {"tp_size": 2, "model_path": "m"})
    older.handlers["/server_info"] = reply(404, {"detail": "Not Found"})
    older.handlers["/get_server_info"] = reply(200, {"tp_size": 4})
    after.handlers["/server_info"] = reply(200, {"tp_size": 10**9})  # a peer's figure past any TP size: one rank
    groups = {node.url: keeps_groups(node) for node in (plain, after, older)}
    lb = start_lb(*node_args(plain.url, after.url, older.url))
    wait_until(lambda: all(n["health"] == "healthy" for n in lb.nodes()), timeout=10, what="the first checks")
    short = lb.http.post(INIT, json={**GROUP, "world_size": 4})
    assert short.status_code == 400 and short.json()["error"]["world_size"] == 8, short.text
    joined = lb.http.post(INIT, json={**GROUP, "world_size": 8})
    assert joined.status_code == 200, joined.text
    assert {r["node"]: r["rank_offset"] for r in joined.json()["results"]} == {plain.url: 1, after.url: 3,
                                                                              older.url: 4}
    assert all(names == {"weight_update_group"} for names in groups.values())


def test_a_node_removed_while_an_init_checks_the_nodes_is_in_no_group(fakes: FakeCluster, start_lb) -> None:
    """An init checks every node before it counts their ranks; a node removed meanwhile gets no join and no
    rank (the ranks have no hole), and the ``world_size`` is counted without it."""
    kept, leaving = fakes.start(2)
    groups = {node.url: keeps_groups(node) for node in (kept, leaving)}
    lb = start_lb(*node_args(kept.url, leaving.url), "--health-interval", "60", fast_health=False)
    wait_until(lambda: all(n["health"] == "healthy" for n in lb.nodes()), timeout=10, what="the first checks")
    gate = Gate(fakes)
    num_checks = len(leaving.requests_to("/memory_occupation"))

    async def slow_check(node: FakeNode, ex: Exchange) -> None:
        await gate.wait()
        ex.respond(200, node.state)

    leaving.handlers["/memory_occupation"] = slow_check
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        init = pool.submit(lb.http.post, INIT, json=GROUP)
        wait_until(lambda: len(leaving.requests_to("/memory_occupation")) > num_checks, timeout=10,
                   what="the init's check of the node")
        assert lb.http.delete("/nodes", params={"url": leaving.url}).status_code == 200
        gate.open()
        answer = init.result(timeout=20)
    assert answer.status_code == 400 and answer.json()["error"]["rank_offsets"] == {kept.url: 1}, answer.text
    assert answer.json()["error"]["world_size"] == 2
    assert kept.requests_to(INIT) == [] and leaving.requests_to(INIT) == []
    joined = lb.http.post(INIT, json={**GROUP, "world_size": 2})
    assert joined.status_code == 200 and [r["node"] for r in joined.json()["results"]] == [kept.url], joined.text
    assert groups == {kept.url: {"weight_update_group"}, leaving.url: set()}


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


def test_a_role_with_no_node_in_the_group_goes_to_that_roles_members(fakes: FakeCluster, start_lb) -> None:
    """A group formed through this LB for prefill only, and for decode elsewhere (another LB replica): an update
    ``?role=decode`` was a 503 ``no_nodes`` ("no decode nodes") with a decode member right there."""
    prefill, decode = fakes.start(2)
    groups = {node.url: keeps_groups(node) for node in (prefill, decode)}
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url)
    one = {**GROUP, "world_size": 2, "group_name": "g"}
    assert lb.http.post(INIT, params={"role": "prefill"}, json=one).status_code == 200
    groups[decode.url].add("g")  # joined through another replica
    update = lb.http.post(UPDATE, params={"role": "decode"}, json={**BROADCAST, "group_name": "g"})
    assert update.status_code == 200 and [r["node"] for r in update.json()["results"]] == [decode.url], update.text
    left = lb.http.post(DESTROY, params={"role": "decode"}, json={"group_name": "g"})
    assert left.status_code == 200 and [r["node"] for r in left.json()["results"]] == [decode.url], left.text
    assert groups == {prefill.url: {"g"}, decode.url: set()}
    # the prefill nodes this LB formed the group on are still its group's
    rest = lb.http.post(DESTROY, params={"role": "prefill"}, json={"group_name": "g"})
    assert rest.status_code == 200 and [r["node"] for r in rest.json()["results"]] == [prefill.url], rest.text
    assert groups == {prefill.url: set(), decode.url: set()}


def test_a_node_back_under_another_role_is_still_in_the_group_of_its_first_role(fakes: FakeCluster,
                                                                              start_lb) -> None:
    """A prefill node of a group leaves and joins again as a decode node: it still holds its prefill rank, so
    an update ``?role=prefill`` must reach it (it went to the other prefill node only: the trainer's broadcast to
    the group would wait for a rank never called)."""
    first, second = fakes.start(2)
    groups = {node.url: keeps_groups(node) for node in (first, second)}
    lb = start_lb("--prefill", first.url, "--prefill", second.url)
    assert lb.http.post(INIT, params={"role": "prefill"}, json=GROUP).status_code == 200
    assert lb.http.delete("/nodes", params={"url": second.url}).status_code == 200
    assert lb.http.post("/nodes", json={"url": second.url, "role": "decode"}).status_code == 201
    update = lb.http.post(UPDATE, params={"role": "prefill"}, json=BROADCAST)
    assert update.status_code == 200, update.text
    assert sorted(r["node"] for r in update.json()["results"]) == sorted([first.url, second.url])
    left = lb.http.post(DESTROY, params={"role": "prefill"}, json={})
    assert left.status_code == 200 and len(left.json()["results"]) == 2, left.text
    assert groups == {first.url: set(), second.url: set()}


def test_a_node_back_under_another_spelling_is_called_as_the_member_it_is(fakes: FakeCluster, start_lb) -> None:
    """A node of a group leaves as ``localhost`` and joins again as ``127.0.0.1``: the update's answer named the
    URL that is no longer a member, and the state it carried went to that old node, so the LB routed the member
    by its old weight version (a request pinned to the new one: 503) until its next check."""
    node = fakes.start_one()
    groups = keeps_groups(node)
    spelled = f"http://localhost:{node.port}"
    lb = start_lb("--node", spelled, "--health-interval", "60", fast_health=False)
    wait_until(lambda: lb.node(spelled)["health"] == "healthy", timeout=10, what="the node's first check")
    assert lb.http.post(INIT, json={**GROUP, "world_size": 2}).status_code == 200
    assert lb.http.delete("/nodes", params={"url": spelled}).status_code == 200
    assert lb.http.post("/nodes", json={"url": node.url}).status_code == 201
    node.state = {**node.state, "weight_version": "v2"}  # what its update answer carries
    update = lb.http.post(UPDATE, json={**BROADCAST, "weight_version": "v2"})
    assert update.status_code == 200 and [r["node"] for r in update.json()["results"]] == [node.url], update.text
    assert lb.node(node.url)["weight_version"] == "v2"
    pinned = lb.http.post("/generate", json={"text": "x"}, headers={"X-Weight-Version": "v2"})
    assert pinned.status_code == 200, pinned.text
    left = lb.http.post(DESTROY, json={})
    assert left.status_code == 200 and [r["node"] for r in left.json()["results"]] == [node.url], left.text
    assert groups == set()
    # forgotten: the next init's group is its own (a stale entry would get this destroy too, and fail it)
    assert lb.http.post(INIT, json={**GROUP, "world_size": 2}).status_code == 200
    again = lb.http.post(DESTROY, json={})
    assert again.status_code == 200 and len(again.json()["results"]) == 1, again.text


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


def test_a_dead_node_of_a_destroyed_group_is_not_in_the_next_group_of_its_name(fakes: FakeCluster,
                                                                                  start_lb) -> None:
    """A node of the group dies and is removed; the trainer destroys the group (502: that node is unreachable)
    and forms it again, same name, over the members of now. Each later update went to the dead node too (the
    new group was merged with what was left of the old one): 502 on every update, for good."""
    first, dead, later = fakes.start(3)
    groups = {node.url: keeps_groups(node) for node in (first, dead, later)}
    lb = start_lb(*node_args(first.url, dead.url))
    assert lb.http.post(INIT, json=GROUP).status_code == 200
    dead.stop()
    assert lb.http.delete("/nodes", params={"url": dead.url}).status_code == 200
    assert lb.http.post("/nodes", json={"url": later.url}).status_code == 201
    failed = lb.http.post(DESTROY, json={})
    assert failed.status_code == 502 and [f["node"] for f in failed.json()["failures"]] == [dead.url], failed.text
    assert lb.http.post(INIT, json=GROUP).status_code == 200
    update = lb.http.post(UPDATE, json=BROADCAST)
    assert update.status_code == 200, update.text
    assert sorted(r["node"] for r in update.json()["results"]) == sorted([first.url, later.url])
    # the destroy still goes to the dead node (it may come back holding its group), and to the new group's
    again = lb.http.post(DESTROY, json={})
    assert again.status_code == 502 and [f["node"] for f in again.json()["failures"]] == [dead.url], again.text
    assert groups == {first.url: set(), dead.url: {"weight_update_group"}, later.url: set()}


def test_a_node_a_rollback_could_not_take_out_gets_the_next_destroy(fakes: FakeCluster, start_lb) -> None:
    """An init of a name the LB knows (formed for prefill) fails for decode; the rollback's destroy fails on the
    decode node that joined. The next destroy of the name went to the prefill group only: the decode node kept
    the group, and refused every later init of that name (409)."""
    prefill, joined, failing = fakes.start(3)
    groups = {node.url: keeps_groups(node) for node in (prefill, joined, failing)}
    lb = start_lb("--prefill", prefill.url, "--decode", joined.url, "--decode", failing.url)
    one = {**GROUP, "world_size": 2, "group_name": "g"}
    assert lb.http.post(INIT, params={"role": "prefill"}, json=one).status_code == 200

    async def refuse(node: FakeNode, ex: Exchange) -> None:
        ex.respond(500, {"error": {"type": "internal_error", "message": "join failed"}})

    async def unavailable(node: FakeNode, ex: Exchange) -> None:
        ex.respond(503, {"error": {"type": "engine_unavailable", "message": "engine restarting"}})

    failing.handlers[INIT] = refuse
    destroy = joined.handlers[DESTROY]
    joined.handlers[DESTROY] = unavailable
    init = lb.http.post(INIT, params={"role": "decode"}, json={**one, "world_size": 3})
    assert init.status_code == 502 and [r["node"] for r in init.json()["rolled_back"]] == [joined.url], init.text
    assert groups[joined.url] == {"g"}
    joined.handlers[DESTROY] = destroy
    left = lb.http.post(DESTROY, json={"group_name": "g"})
    assert left.status_code == 200, left.text
    assert sorted(r["node"] for r in left.json()["results"]) == sorted([prefill.url, joined.url])
    assert groups == {prefill.url: set(), joined.url: set(), failing.url: set()}


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

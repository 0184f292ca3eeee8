"""``--max-nodes``: the most members an LB holds, whoever adds them (the admin API, DNS discovery)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lb.fakes import FakeCluster
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(60)


def test_post_nodes_past_max_nodes_is_a_409_that_changes_nothing(fakes: FakeCluster, start_lb) -> None:
    """Found by review: ``POST /nodes`` grew the membership without bound, each member costing health checks,
    pooled connections and metric series."""
    first, second, third = fakes.start(3)
    lb = start_lb("--node", first.url, "--max-nodes", "2")
    assert lb.http.post("/nodes", json={"url": second.url}).status_code == 201
    refused = lb.http.post("/nodes", json={"url": third.url, "role": "decode"})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["type"] == "too_many_nodes" and "--max-nodes" in error["message"] and error["max_nodes"] == 2
    assert {n["url"] for n in lb.nodes()} == {first.url, second.url}
    assert not third.requests_to("/health") and lb.metric("handoff_lb_nodes", role="decode") == 0
    again = lb.http.post("/nodes", json={"url": second.url})  # a member already: still the more precise answer
    assert again.status_code == 409 and again.json()["error"]["type"] == "node_exists"
    assert lb.http.delete("/nodes", params={"url": second.url}).status_code == 200
    assert lb.http.post("/nodes", json={"url": third.url}).status_code == 201


def test_dns_discovery_leaves_out_what_is_past_max_nodes(fakes: FakeCluster, start_lb, tmp_path: Path) -> None:
    """Found by review: a DNS answer of any size became that many members."""
    flag_node = fakes.start_one()
    found = [fakes.start_one(host="127.0.0.2")]
    port = found[0].port
    found.append(fakes.start_one(host="127.0.0.3", port=port))
    answers = tmp_path / "dns.json"

    def publish(addresses: list[str]) -> None:
        tmp = answers.with_suffix(".tmp")
        tmp.write_text(json.dumps({"nodes.test": addresses}))
        tmp.replace(answers)

    publish([f"127.0.0.{i}" for i in range(2, 12)])
    lb = start_lb("--node", flag_node.url, "--max-nodes", "3", "--discover-dns", f"mixed=nodes.test:{port}",
                  "--discover-interval", "0.2", module="tests.lb.dns_lb", env={"HANDOFF_TEST_DNS_FILE": str(answers)})
    assert {n["url"] for n in lb.nodes()} == {flag_node.url, *(node.url for node in found)}
    assert "8 node(s) left out, the load balancer holds --max-nodes (3)" in lb.log()
    refused = lb.http.post("/nodes", json={"url": "http://127.0.0.20:1"})
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "too_many_nodes"
    publish(["127.0.0.3"])  # room again: discovery keeps following its answer
    wait_until(lambda: {n["url"] for n in lb.nodes()} == {flag_node.url, found[1].url}, timeout=10,
               what="the members to follow DNS")
    assert lb.http.get("/health").json()["num_nodes"] == 2

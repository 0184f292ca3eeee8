"""Membership, health checks and the cluster views of a real LB process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.lb.behaviours import reply
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, node_args, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)


def test_nodes_from_flags(fakes: FakeCluster, start_lb) -> None:
    mixed, prefill, decode = fakes.start(3)
    plain = fakes.start_one(is_sidecar=False)
    lb = start_lb("--node", mixed.url, "--prefill", f"{prefill.url}@8998", "--decode", decode.url,
                  "--node", plain.url)
    views = {n["url"]: n for n in lb.nodes()}
    assert [(views[n.url]["role"], views[n.url]["kind"]) for n in (mixed, prefill, decode, plain)] == [
        ("mixed", "sidecar"), ("prefill", "sidecar"), ("decode", "sidecar"), ("mixed", "plain")]
    assert views[prefill.url]["bootstrap_port"] == 8998
    sidecar = views[mixed.url]
    assert sidecar["health"] == "healthy" and sidecar["routable"] and sidecar["source"] == "flag"
    assert sidecar["tags"]["weights"] == {"state": "resident", "bytes": 1000}
    assert sidecar["weight_version"] == "default" and sidecar["in_flight"] == 0
    assert sidecar["last_seen"] is not None and sidecar["last_error"] is None
    assert views[plain.url]["health"] == "healthy" and views[plain.url]["routable"]
    assert plain.requests_to("/health")
    assert lb.metric("handoff_lb_nodes", role="mixed") == 2
    assert lb.metric("handoff_lb_node_healthy", node=mixed.url, role="mixed") == 1
    health = lb.http.get("/health").json()
    assert health == {"status": "ok", "num_nodes": 4, "num_routable": 4}


def test_admin_api_adds_and_removes_nodes(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb)
    added = shared_lb.http.post("/nodes", json={"url": node.url + "/", "role": "decode"})
    assert added.status_code == 201
    assert added.json()["node"]["url"] == node.url and added.json()["node"]["health"] == "healthy"
    again = shared_lb.http.post("/nodes", json={"url": node.url, "role": "mixed"})
    assert again.status_code == 409 and again.json()["error"]["type"] == "node_exists"
    for bad in ({"url": "ftp://x"}, {"url": "http://h:1/path"}, {"url": node.url, "role": "gpu"},
                {"url": node.url, "extra": 1}, {"url": "http://h:1", "bootstrap_port": 9}):
        answer = shared_lb.http.post("/nodes", json=bad)
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", bad
    removed = shared_lb.http.request("DELETE", "/nodes", json={"url": node.url})
    assert removed.status_code == 200 and removed.json()["removed"]["url"] == node.url
    missing = shared_lb.http.delete("/nodes", params={"url": node.url})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "node_not_found"
    assert shared_lb.http.delete("/nodes").status_code == 400
    assert shared_lb.nodes() == []


def test_health_goes_down_and_comes_back(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    node.handlers["/memory_occupation"] = reply(500, b"oops")
    wait_until(lambda: shared_lb.node(node.url)["health"] == "unhealthy", timeout=10, what="unhealthy")
    assert "500" in shared_lb.node(node.url)["last_error"]
    assert shared_lb.metric("handoff_lb_node_healthy", node=node.url, role="mixed") == 0
    del node.handlers["/memory_occupation"]
    wait_until(lambda: shared_lb.node(node.url)["routable"], timeout=10, what="healthy again")


def test_memory_occupation_is_aggregated_from_a_fresh_check(fakes: FakeCluster, start_lb) -> None:
    nodes = fakes.start(3)
    lb = start_lb(*node_args(*(n.url for n in nodes)), "--health-interval", "60", fast_health=False)
    nodes[0].set_released()
    nodes[1].state["weight_version"] = "step-12"
    view = lb.http.get("/memory_occupation").json()
    assert view["total"] == 3 and view["healthy"] == 3 and view["serving"] == 2
    assert view["tags"]["weights"] == {"resident": 2, "releasing": 0, "released": 1, "resuming": 0,
                                       "unknown": 0, "bytes": 2000}
    assert view["weight_versions"] == {"default": 2, "step-12": 1}
    assert view["device"] == {"free_bytes": 3, "total_bytes": 6}


def test_dns_discovery_adds_and_removes_nodes(fakes: FakeCluster, start_lb, tmp_path: Path) -> None:
    first = fakes.start_one(host="127.0.0.1")
    second = fakes.start_one(host="127.0.0.2", port=first.port)
    third = fakes.start_one(host="127.0.0.3", port=first.port)
    answers = tmp_path / "dns.json"

    def publish(hosts: dict[str, list[str]]) -> None:
        tmp = answers.with_suffix(".tmp")
        tmp.write_text(json.dumps(hosts))
        tmp.replace(answers)

    publish({"nodes.test": ["127.0.0.1", "127.0.0.2"]})
    lb = start_lb("--discover-dns", f"mixed=nodes.test:{first.port}", "--discover-interval", "0.2",
                  module="tests.lb.dns_lb", env={"HANDOFF_TEST_DNS_FILE": str(answers)})

    def members() -> set[str]:
        return {n["url"] for n in lb.nodes()}

    assert members() == {first.url, second.url}
    assert {n["source"] for n in lb.nodes()} == {f"dns mixed=nodes.test:{first.port}"}
    publish({"nodes.test": ["127.0.0.2", "127.0.0.3"]})
    wait_until(lambda: members() == {second.url, third.url}, timeout=10, what="membership to follow DNS")
    wait_until(lambda: lb.node(third.url)["routable"], timeout=10, what="the new node checked")
    publish({})  # the lookup fails: keep what we have
    wait_until(lambda: "lookup failed" in lb.log(), timeout=10, what="a failed lookup")
    assert members() == {second.url, third.url}
    log = lb.log()
    assert f"added ['{third.url}']" in log and f"removed ['{first.url}']" in log


@pytest.mark.parametrize("url", ["http://[::1", "http://h\u00e9llo:8000", "http://h\x00st:8000", "http://[::1]x:80",
                                 "http://[fe80::1%25eth0]:80", "http://a..b:1", "http://h:0", "http://[::]:80",
                                 "http://224.0.0.1:80", "http://[ff02::1]:80", "http://255.255.255.255:80",
                                 "http://h:" + "9" * 5000])
def test_a_url_the_lb_cannot_use_never_joins(module_fakes: FakeCluster, shared_lb: LB, url: str) -> None:
    """A bad URL is a 400 naming the problem and no member: later fan-outs still answer for the real nodes."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/nodes", json={"url": url})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert "node URL" in answer.json()["error"]["message"]
    assert [n["url"] for n in shared_lb.nodes()] == [node.url]
    flushed = shared_lb.http.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["total"] == 1


def test_one_address_under_two_spellings_is_one_node(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    port = node.url.rsplit(":", 1)[1]
    set_members(shared_lb, f"http://LOCALHOST.:{port}/")
    assert [n["url"] for n in shared_lb.nodes()] == [f"http://localhost:{port}"]
    for spelling in (node.url, f"http://[::ffff:127.0.0.1]:{port}", f"http://localhost:{port}"):
        again = shared_lb.http.post("/nodes", json={"url": spelling})
        assert again.status_code == 409 and again.json()["error"]["type"] == "node_exists", spelling
        assert again.json()["error"]["node"] == f"http://localhost:{port}"
    before = len(node.requests_to("/flush_cache"))
    assert shared_lb.http.post("/flush_cache").json()["total"] == 1
    assert len(node.requests_to("/flush_cache")) == before + 1  # the node got the call once


def test_the_listen_all_address_of_a_member_is_refused_not_a_second_member(module_fakes: FakeCluster,
                                                                           shared_lb: LB) -> None:
    """``http://0.0.0.0:PORT`` (what a server prints when it listens on every interface) reaches this host: it was
    a second member for the node at ``127.0.0.1:PORT``, which then got every control call twice (two ranks in a
    weight group). It is a 400 saying what to give instead."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/nodes", json={"url": f"http://0.0.0.0:{node.port}"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert "127.0.0.1" in answer.json()["error"]["message"]
    assert [n["url"] for n in shared_lb.nodes()] == [node.url]
    before = len(node.requests_to("/flush_cache"))
    assert shared_lb.http.post("/flush_cache").json()["total"] == 1
    assert len(node.requests_to("/flush_cache")) == before + 1


@pytest.mark.parametrize("spelling", ["0", "0.0", "0x0", "0."])
def test_a_number_spelling_of_the_listen_all_address_is_refused_too(module_fakes: FakeCluster, shared_lb: LB,
                                                                    spelling: str) -> None:
    """``http://0:PORT`` is ``0.0.0.0`` to the resolver (``inet_aton``'s short and hex forms): it was taken as a host
    name, resolved to ``0.0.0.0``, which no member has, and became a second member for the node at
    ``127.0.0.1:PORT`` (every control call twice). A number spelling of an IPv4 address is that address."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/nodes", json={"url": f"http://{spelling}:{node.port}"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert "0.0.0.0" in answer.json()["error"]["message"]
    assert [n["url"] for n in shared_lb.nodes()] == [node.url]
    before = len(node.requests_to("/flush_cache"))
    assert shared_lb.http.post("/flush_cache").json()["total"] == 1
    assert len(node.requests_to("/flush_cache")) == before + 1


@pytest.mark.parametrize("port", ["\u00b2", "\u0668\u0660"])
def test_a_port_of_other_digits_is_refused_naming_the_url(module_fakes: FakeCluster, shared_lb: LB, port: str) -> None:
    """A port is ASCII digits: ``²`` passed ``str.isdigit`` and the refusal was ``int()``'s own words ("invalid
    literal for int()"), naming neither the URL nor the port; Arabic-Indic digits were taken as port 80."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/nodes", json={"url": f"http://127.0.0.1:{port}"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    assert "the port must be a number in 1-65535" in answer.json()["error"]["message"], answer.text
    assert [n["url"] for n in shared_lb.nodes()] == [node.url]


def test_a_huge_node_url_is_refused_without_being_sent_back(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """A refusal names the URL in at most 200 characters (a megabyte URL was sent back whole), a bootstrap port in
    at most 20 digits."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/nodes", json={"url": "http://h/" + "x" * 1_000_000})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text[:300]
    assert len(answer.content) < 1000
    port = shared_lb.http.post("/nodes", content=b'{"url": "http://h:1", "role": "prefill", "bootstrap_port": '
                               + b"9" * 4000 + b"}", headers={"Content-Type": "application/json"})
    assert port.status_code == 400 and len(port.content) < 1000, port.text[:300]
    assert [n["url"] for n in shared_lb.nodes()] == [node.url]

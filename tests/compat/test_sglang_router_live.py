"""The LB beside the real sglang-router (0.3.x, the ``bench`` extra), call by call, over the same real nodes.

What RL frameworks send a router to manage its workers (slime and NeMo-RL:
``POST /workers {"url", "worker_type"}`` with ``raise_for_status``, ``GET
/workers`` read for ``workers[].url`` and ``id``, ``DELETE /workers/{id}``;
verl: the legacy ``/add_worker?url=`` / ``/remove_worker?url=``, which 0.3.x
dropped, 404) and the cluster calls they and operators make. Each call goes to
both; where a framework's client code branches on the answer (its status class,
a field it reads), the two must agree. Deliberate differences (docs/api.md): the
router adds a worker in the background (202, a UUID ``worker_id``) where the LB
adds it before answering (200); its errors are ``{"error": str, "code"}`` where
the LB's are SPEC's; it answers 400 to a ``/workers/{id}`` that is not a UUID,
the LB takes a percent-encoded URL there too.

sglang-router is not in the ``test`` extra: without it this module is skipped.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import pytest

from handoff.cluster.local import LocalCluster
from tests.support.procs import ServerProcess, wait_until

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.timeout(240)

NIL_UUID = "00000000-0000-0000-0000-000000000000"
READ = ("id", "url", "worker_type", "is_healthy", "load")  # what the frameworks (and operators) read of a worker


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no router outlives a killed run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def pair(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, httpx.Client]]:
    """An LB and an sglang-router, both with no worker yet; each test leaves them with none."""
    logs = tmp_path_factory.mktemp("router-diff")
    lb = ServerProcess("lb", ["--health-interval", "0.2", "--health-timeout", "1"], log_dir=logs).start()
    port = _free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
            "--log-level", "warn", "--worker-startup-check-interval", "1", "--health-check-interval-secs", "60"]
    with open(Path(logs) / "router.log", "wb") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    clients = {"lb": httpx.Client(base_url=lb.url, timeout=30),
               "router": httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)}
    try:
        wait_until(lambda: router.poll() is None and _answers(clients["router"]), timeout=60, what="the router up")
        yield clients
    finally:
        for client in clients.values():
            client.close()
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(5)
        lb.stop()


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def _listed(client: httpx.Client, url: str) -> dict[str, Any] | None:
    answer = client.get("/workers")
    answer.raise_for_status()
    return next((w for w in answer.json()["workers"] if w["url"] == url), None)


def _register(pair: dict[str, httpx.Client], url: str) -> dict[str, dict[str, Any]]:
    """slime's and NeMo-RL's registration on both; then NeMo-RL's wait until ``GET /workers`` lists it healthy."""
    for name, client in pair.items():
        added = client.post("/workers", json={"url": url, "worker_type": "regular"})
        assert added.is_success, (name, added.text)  # raise_for_status: 200 here, 202 from the router
        assert {"worker_id", "url", "location"} <= set(added.json()), (name, added.text)
    return {name: wait_until(lambda c=client: (w := _listed(c, url)) and w["is_healthy"] and w, timeout=60,
                             what=f"{url} listed by the {name}") for name, client in pair.items()}


def _unregister(pair: dict[str, httpx.Client], url: str) -> None:
    """slime's and NeMo-RL's shutdown: find the worker by ``url`` in ``GET /workers``, delete it by ``id``."""
    for name, client in pair.items():
        worker = _listed(client, url)
        assert worker is not None, name
        assert client.delete(f"/workers/{worker['id']}").is_success, name
        wait_until(lambda c=client: _listed(c, url) is None, timeout=30, what=f"{url} gone from the {name}")


def test_workers_added_listed_read_and_removed_as_the_frameworks_do(pair, cluster: LocalCluster) -> None:
    url = cluster.nodes[0].url
    listed = _register(pair, url)
    for name, worker in listed.items():
        assert set(READ) <= set(worker) and worker["worker_type"] == "regular" and worker["load"] >= 0, name
    views = {name: client.get("/workers").json() for name, client in pair.items()}
    assert {k: (v["total"], v["stats"]) for k, v in views.items()} == {
        k: (1, {"regular_count": 1, "prefill_count": 0, "decode_count": 0}) for k in views}
    for name, client in pair.items():  # by id, where the add's answer points (its location)
        read = client.get(f"/workers/{listed[name]['id']}")
        assert read.status_code == 200 and read.json()["url"] == url, (name, read.text)
    again = {name: client.post("/workers", json={"url": url}) for name, client in pair.items()}
    assert all(a.is_success for a in again.values()) and all(_listed(c, url) for c in pair.values())
    assert [len(c.get("/workers").json()["workers"]) for c in pair.values()] == [1, 1]  # a duplicate add: one
    _unregister(pair, url)
    for name, client in pair.items():
        gone = client.delete(f"/workers/{listed[name]['id']}")
        assert gone.status_code == 404, (name, gone.text)


def test_what_a_bad_worker_call_answers(pair) -> None:
    """The status class a client branches on; the LB's body is SPEC's (the router's is its own)."""
    for name, client in pair.items():  # an id nobody has
        for method in ("GET", "DELETE"):
            answer = client.request(method, f"/workers/{NIL_UUID}")
            assert answer.status_code == 404, (name, method, answer.text)
    missing = {name: client.post("/workers", json={}) for name, client in pair.items()}
    assert missing["router"].status_code == 422 and missing["lb"].status_code == 400, missing
    garbage = {name: client.post("/workers", content=b"{not json", headers={"Content-Type": "application/json"})
               for name, client in pair.items()}
    assert [g.status_code for g in garbage.values()] == [400, 400]
    not_uuid = {name: client.delete("/workers/" + quote("http://127.0.0.1:9", safe=""))
                for name, client in pair.items()}
    assert not_uuid["router"].status_code == 400 and not_uuid["lb"].status_code == 404, not_uuid
    for answer in (missing["lb"], garbage["lb"], not_uuid["lb"]):
        assert set(answer.json()["error"]) >= {"type", "message"}, answer.text


def test_the_cluster_calls_through_both(pair, cluster: LocalCluster) -> None:
    url = cluster.nodes[1].url
    _register(pair, url)
    try:
        model = {name: client.get("/get_model_info") for name, client in pair.items()}
        assert all(m.status_code == 200 for m in model.values())
        router_info = model["router"].json()
        assert {k: model["lb"].json()[k] for k in router_info} == router_info  # the LB's: the router's and more
        ids = {name: [m["id"] for m in client.get("/v1/models").json()["data"]] for name, client in pair.items()}
        assert ids["lb"] == ids["router"] == ["builtin:tiny"]
        for path in ("/health", "/health_generate"):
            assert [c.get(path).status_code for c in pair.values()] == [200, 200], path
        assert [c.post("/flush_cache").status_code for c in pair.values()] == [200, 200]
        # a node's server info here (what slime reads of an engine), the router's own counts there: both 200
        assert [c.get("/get_server_info").status_code for c in pair.values()] == [200, 200]
    finally:
        _unregister(pair, url)


def test_the_legacy_worker_calls_verl_sends(pair, cluster: LocalCluster) -> None:
    """verl registers with ``/add_worker?url=`` and leaves with ``/remove_worker?url=``; sglang-router 0.3.x
    answers 404 to both (and to ``/list_workers``), the LB still takes them."""
    url = cluster.nodes[0].url
    lb = pair["lb"]
    assert lb.post("/add_worker", params={"url": url}).status_code == 200
    assert lb.get("/list_workers").json()["urls"] == [url] and _listed(lb, url)
    assert lb.post("/remove_worker", params={"url": url}).status_code == 200
    assert lb.get("/list_workers").json()["urls"] == []
    assert pair["router"].post("/add_worker", params={"url": url}).status_code == 404  # the LB's extra

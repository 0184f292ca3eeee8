"""Two LB replicas in front of the same two real nodes, an RL loop's calls alternating between them as a Kubernetes
Service spreads them: what holds when each call may reach a replica that did not see the one before it.

LB A checks its nodes every 0.2 s; LB B only every 60 s, so B's view of the nodes is what it saw at start or learned
from its own calls (the worst case of a replica that has not polled yet)."""

from __future__ import annotations

import threading
from typing import Iterator

import httpx
import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.weight_sync import serialize_named_tensors
from tests.lb.lbproc import FAST_HEALTH, node_args
from tests.support.procs import ServerProcess, wait_until
from tests.support.trainer import Trainer
from tests.support.weights import greedy, tiny_weights

pytestmark = pytest.mark.timeout(180)

GEN = {"text": "x", "sampling_params": {"max_new_tokens": 1}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, lb_args=tuple(FAST_HEALTH), sidecar_args=("--engine-poll-interval", "0.2"),
                       engine_args=("--weight-sync-timeout", "20"), weights_backup="cpu")
    with LocalCluster(spec, tmp_path_factory.mktemp("two_lbs")) as c:
        yield c


@pytest.fixture(scope="module")
def lbs(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """(A, B): the cluster's LB, and a second one over the same nodes that does not poll them within a test."""
    second = ServerProcess("lb", ["--health-interval", "60", *node_args(*(n.url for n in cluster.nodes))],
                           log_dir=tmp_path_factory.mktemp("lb_b"), name="lb-b")
    second.start()
    try:
        with httpx.Client(base_url=cluster.url, timeout=120) as a, httpx.Client(base_url=second.url, timeout=120) as b:
            yield a, b
    finally:
        second.stop()


@pytest.fixture
def both(lbs, cluster: LocalCluster) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """A and B, and afterwards every node resumed, serving and in no group, as both LBs see it."""
    yield lbs
    a, b = lbs
    assert a.post("/resume_memory_occupation", json={}).status_code == 200
    assert a.post("/continue_generation", json={}).status_code == 200
    for client in lbs:
        client.post("/resume_memory_occupation", json={})  # B learns the nodes' state from the answers
    wait_until(lambda: all(n["routable"] for c in lbs for n in c.get("/nodes").json()["nodes"]), timeout=30,
               what="every node routable on both LBs")


def is_clear_refusal(r: httpx.Response) -> bool:
    return r.status_code == 503 and r.json()["error"]["type"] == "no_available_node" and "retry-after" in r.headers


def test_release_through_a_and_generation_through_b_at_once_is_a_clear_503(both, cluster) -> None:
    a, b = both
    assert all(n["routable"] for n in b.get("/nodes").json()["nodes"])
    r = a.post("/release_memory_occupation", json={})
    assert r.status_code == 200, r.text
    r = b.post("/generate", json=GEN)  # B still takes both nodes for serving: each refuses, nothing ran
    assert is_clear_refusal(r), (r.status_code, r.text)
    r = b.post("/resume_memory_occupation", json={})
    assert r.status_code == 200, r.text
    wait_until(lambda: a.post("/generate", json=GEN).status_code == 200, timeout=10, what="A generates again")


def test_generation_through_a_stale_lb_between_release_and_resume_never_runs_and_never_500s(both) -> None:
    """Every answer while the other replica releases and resumes is a generation or a clear 503."""
    a, b = both
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def generate() -> None:
        while not stop.is_set():
            answers.append(b.post("/generate", json=GEN))

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        for _ in range(3):
            assert a.post("/release_memory_occupation", json={}).status_code == 200
            assert a.post("/resume_memory_occupation", json={}).status_code == 200
    finally:
        stop.set()
        thread.join(60)
    assert answers and all(r.status_code == 200 or is_clear_refusal(r) for r in answers), \
        {(r.status_code, r.text[:200]) for r in answers}


def test_a_weight_group_formed_through_a_is_updated_and_destroyed_through_b(both, cluster) -> None:
    a, b = both
    weights = tiny_weights(5)
    trainer = Trainer(str(a.base_url).rstrip("/"), world_size=3)
    r = trainer.join()
    assert r.status_code == 200, r.text
    try:
        trainer.url = str(b.base_url).rstrip("/")  # B did not see the init: it sends the update to its members
        r = trainer.push(list(weights.items()), weight_version="two-lbs")
        assert r.status_code == 200 and r.json()["total"] == 2, r.text
        assert len({tuple(map(tuple, greedy(n.url))) for n in cluster.nodes}) == 1
        r = a.get("/get_weight_version")
        assert r.json()["weight_version"] == "two-lbs" and r.json()["consistent"] is True, r.text
    finally:
        r = trainer.leave()
    assert r.status_code == 200 and r.json()["total"] == 2, r.text
    # A still counts the group it formed as alive; the next init of the name through A forms a new one
    trainer = Trainer(str(a.base_url).rstrip("/"), world_size=3)
    r = trainer.join()
    assert r.status_code == 200, r.text
    assert trainer.leave().status_code == 200
    # B checks world_size against its own members, the same nodes
    r = b.post("/init_weights_update_group", json=Trainer(str(b.base_url), world_size=2).init_body())
    assert r.status_code == 400 and r.json()["error"]["world_size"] == 3, r.text


def test_a_tensor_update_through_one_lb_is_the_version_the_other_reports(both, cluster, tmp_path) -> None:
    a, b = both
    weights = tiny_weights(7)  # kept alive: the payload names its shared memory
    payload = serialize_named_tensors(weights.items())
    r = a.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "weight_version": "t-a"})
    assert r.status_code == 200, r.text
    r = b.get("/get_weight_version")
    assert r.json()["weight_version"] == "t-a" and r.json()["consistent"] is True, r.text
    r = b.post("/generate", json=GEN, headers={"X-Weight-Version": "t-a"})
    assert r.status_code == 200, r.text
    r = b.post("/update_weights_from_tensor", params={"node": cluster.nodes[0].url},
               json={"serialized_named_tensors": [payload], "weight_version": "t-b"})
    assert r.status_code == 200, r.text
    r = a.get("/get_weight_version")
    assert r.json()["consistent"] is False and r.json()["weight_version"] is None, r.text
    r = b.post("/update_weight_version", json={"new_version": "default"})
    assert r.status_code == 200, r.text
    assert a.get("/get_weight_version").json()["weight_version"] == "default"


def test_pause_through_a_holds_generation_through_b_until_continue_through_b(both, cluster: LocalCluster) -> None:
    a, b = both
    assert a.post("/pause_generation", json={}).status_code == 200
    answer: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answer.update(r=b.post("/generate", json=GEN)))
    thread.start()
    # B still takes the nodes for serving; the paused node holds the request
    wait_until(lambda: sum(httpx.get(n.url + "/memory_occupation", timeout=5).json()["held"] for n in cluster.nodes)
               == 1, timeout=30, what="the request held by a paused node")
    assert "r" not in answer
    assert b.post("/continue_generation", json={}).status_code == 200
    thread.join(30)
    assert not thread.is_alive(), "the held request was not answered after the continue"
    assert answer["r"].status_code == 200, answer["r"].text


def test_abort_through_b_ends_a_request_running_through_a(both) -> None:
    a, b = both
    body = {"text": "long", "rid": "two-lbs-abort", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    answer: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answer.update(r=a.post("/generate", json=body)))
    thread.start()
    wait_until(lambda: any(n["node_in_flight"] for n in a.get("/nodes").json()["nodes"]), timeout=10,
               what="the request to run")
    r = b.post("/abort_request", json={"rid": "two-lbs-abort"})
    assert r.status_code == 200, r.text
    thread.join(30)
    assert not thread.is_alive(), "the request was not ended by the abort"
    assert answer["r"].json()["meta_info"]["finish_reason"]["type"] == "abort", answer["r"].text



def test_membership_changes_through_the_api_are_the_replica_s_own(both, cluster) -> None:
    """``/remove_worker``, ``/add_worker`` and ``/nodes`` change only the replica they reach (documented: with
    several replicas the members come from DNS discovery)."""
    a, b = both
    node = cluster.nodes[1].url
    assert a.post("/remove_worker", params={"url": node}).status_code == 200
    try:
        assert a.get("/list_workers").json()["urls"] == [cluster.nodes[0].url]
        assert b.get("/list_workers").json()["urls"] == [n.url for n in cluster.nodes]
        r = b.post("/init_weights_update_group", json=Trainer(str(b.base_url), world_size=2).init_body())
        assert r.status_code == 400 and r.json()["error"]["world_size"] == 3, r.text  # B counts both nodes
    finally:
        assert a.post("/nodes", json={"url": node}).status_code == 201
    assert a.get("/list_workers").json() == b.get("/list_workers").json()

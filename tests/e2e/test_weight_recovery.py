"""An RL loop recovers through the LB when a node's engine restarts mid-run (its sidecar up), on each weight path.

A fresh engine serves its start checkpoint, so a node whose weights had been updated is held out with
``weights_stale`` (:mod:`node_sidecar.intent`) until weights reach it again. A reload or a tensor push fanned
out through the LB does that. A broadcast cannot: the fresh engine is in no weight group, so the trainer
destroys the group on every node and joins again with the same ``world_size`` (docs/rl-guide.md).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster, NodeProcesses
from handoff.weight_sync import broadcast_named_tensors, serialize_named_tensors
from tests.support.procs import ServerProcess, wait_until
from tests.support.trainer import Trainer, distributed_body, free_port
from tests.support.weights import greedy, save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(180)

SYNC_TIMEOUT_S = 4  # the engines' and the LB's --weight-sync-timeout: a broadcast that fails costs this long


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, lb_args=("--health-interval", "0.2", "--health-timeout", "1",
                                             "--weight-sync-timeout", str(SYNC_TIMEOUT_S + 6)),
                       sidecar_args=("--engine-poll-interval", "0.2"),
                       engine_args=("--weight-sync-timeout", str(SYNC_TIMEOUT_S)))
    with LocalCluster(spec, tmp_path_factory.mktemp("weight_recovery")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, list[list[int]]]]:
    """Greedy answers of engines loaded from checkpoints of seeds 11 and 12."""
    log_dir = tmp_path_factory.mktemp("ref")
    procs = {seed: ServerProcess("node_engine", ["--model-path", str(save_tiny(
        tmp_path_factory.mktemp(f"ckpt{seed}"), tiny_weights(seed)))], log_dir=log_dir, name=f"ref{seed}")
        for seed in (11, 12)}
    try:
        for proc in procs.values():  # launched together: each loads while the other does
            proc.launch()
        answers = {seed: greedy(proc.wait_ready().url) for seed, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()
    yield answers


@pytest.fixture
def lb(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        yield client
        for proc in cluster.processes():
            if not proc.is_running():
                proc.start(timeout=60)
        start = tiny_weights(0)  # held until the nodes answered: the payload names its shared memory
        r = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors(start.items())], "weight_version": "default"})
        assert r.status_code == 200, r.text
        wait_until(lambda: all(n["routable"] for n in client.get("/nodes").json()["nodes"]), timeout=30,
                   what="every node routable")


def occupation(node: NodeProcesses) -> dict[str, Any]:
    return httpx.get(node.url + "/memory_occupation", timeout=10).json()


def lb_view(lb: httpx.Client, node: NodeProcesses) -> dict[str, Any]:
    return next(n for n in lb.get("/nodes").json()["nodes"] if n["url"] == node.url)


def restart_engine(lb: httpx.Client, node: NodeProcesses) -> None:
    """Kill the node's engine and start a fresh one on its port; wait until the LB sees it held out as stale."""
    node.engine.kill()
    wait_until(lambda: occupation(node)["engine_reachable"] is False, timeout=10, what="the engine seen down")
    node.engine.start(timeout=60)
    wait_until(lambda: lb_view(lb, node)["not_serving_reason"] == "weights_stale", timeout=30,
               what="the LB to see the fresh engine held out")
    assert not lb_view(lb, node)["routable"]


def assert_both_serve(cluster: LocalCluster, lb: httpx.Client, answer: list[list[int]], version: str) -> None:
    wait_until(lambda: all(n["routable"] for n in lb.get("/nodes").json()["nodes"]), timeout=10,
               what="both nodes routable")
    for node in cluster.nodes:
        assert greedy(node.url) == answer
    versions = lb.get("/get_weight_version").json()
    assert versions["weight_version"] == version and versions["consistent"] is True, versions


def test_a_disk_reload_through_the_lb_heals_a_restarted_engine(cluster, lb, reference, tmp_path: Path) -> None:
    step1, step2 = (str(save_tiny(tmp_path / f"step-{s}", tiny_weights(s + 10))) for s in (1, 2))
    r = lb.post("/update_weights_from_disk", json={"model_path": step1, "weight_version": "step-1"})
    assert r.status_code == 200, r.text
    restart_engine(lb, cluster.nodes[0])
    r = lb.post("/update_weights_from_disk", json={"model_path": step2, "weight_version": "step-2"})
    assert r.status_code == 200, r.text
    assert_both_serve(cluster, lb, reference[12], "step-2")


def test_a_tensor_push_through_the_lb_heals_a_restarted_engine(cluster, lb, reference) -> None:
    def push(seed: int, version: str) -> httpx.Response:
        weights = tiny_weights(seed)  # held until the nodes answered: the payload names its shared memory
        return lb.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors(weights.items())], "weight_version": version})

    assert push(11, "step-1").status_code == 200
    restart_engine(lb, cluster.nodes[0])
    r = push(12, "step-2")
    assert r.status_code == 200, r.text
    assert_both_serve(cluster, lb, reference[12], "step-2")


def test_a_trainer_rejoins_after_an_engine_restart_and_its_broadcasts_reach_both_nodes(cluster, lb,
                                                                                       reference) -> None:
    restarted, other = cluster.nodes
    trainer = Trainer(cluster.url, world_size=3)
    r = trainer.join()
    assert r.status_code == 200, r.text
    step1, step2 = list(tiny_weights(11).items()), list(tiny_weights(12).items())
    r = trainer.push(step1, weight_version="step-1")
    assert r.status_code == 200, r.text
    restart_engine(lb, restarted)
    assert lb_view(lb, restarted)["weight_version"] == "default" and lb_view(lb, other)["routable"]
    # the next update: refused at once, naming the restarted node, sent to no node (none waits for broadcasts);
    # the trainer's own broadcast fails too, its peer gone
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lb.post, "/update_weights_from_distributed",
                             json=distributed_body(step2, trainer.group_name, weight_version="step-2"))
        with pytest.raises(RuntimeError):
            broadcast_named_tensors(trainer.group, [t for _, t in step2])
        r = answer.result()
    assert r.status_code == 409 and r.json()["error"]["type"] == "weight_sync_broken", r.text
    assert r.json()["error"]["nodes"] == [restarted.url] and "destroy" in r.json()["error"]["message"]
    assert time.monotonic() - started < SYNC_TIMEOUT_S
    assert greedy(other.url) == reference[11]  # the other node serves step-1 meanwhile, through the LB too
    assert greedy(cluster.url) == reference[11]
    # the recovery: destroy the group on every node (the restarted one holds it no more: a success too) ...
    r = trainer.leave()
    assert r.status_code == 200 and r.json()["total"] == 2, r.text
    assert "holds it no more" in r.json()["results"][[x["node"] for x in r.json()["results"]].index(
        restarted.url)]["body"]["message"]
    # ... join again with the same world_size (on a free master_port, as for any new group), push
    trainer.port = free_port()
    r = trainer.join()
    assert r.status_code == 200, r.text
    assert sorted(x["rank_offset"] for x in r.json()["results"]) == [1, 2]
    r = trainer.push(step2, weight_version="step-2")
    assert r.status_code == 200, r.text
    assert_both_serve(cluster, lb, reference[12], "step-2")
    assert trainer.leave().status_code == 200


def test_a_restarted_engine_serves_again_only_once_buckets_replaced_every_weight(cluster, lb, reference,
                                                                                tmp_path: Path) -> None:
    """A trainer pushes a step in buckets (as verl does): the first bucket after a restart lifted ``weights_stale``
    and the node served a mix of the start checkpoint and the step until the last bucket landed."""
    restarted = cluster.nodes[0]
    weights = tiny_weights(12)
    names = sorted(weights)
    buckets = [names[:len(names) // 2], names[len(names) // 2:]]

    def push(seed: int, keys: list[str], version: str) -> httpx.Response:
        tensors = tiny_weights(seed)  # held until the nodes answered: the payload names its shared memory
        return lb.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors((k, tensors[k]) for k in keys)],
            "weight_version": version})

    def restarted_answer(r: httpx.Response) -> dict[str, Any]:
        assert r.status_code == 200, r.text
        return next(x["body"] for x in r.json()["results"] if x["node"] == restarted.url)

    assert push(11, names, "step-1").status_code == 200
    restart_engine(lb, restarted)
    assert restarted_answer(push(12, buckets[0], "step-2"))["weights_updated_fully"] is False
    view = occupation(restarted)
    assert view["not_serving_reason"] == "weights_stale" and view["weight_version"] == "step-2", view
    assert not lb_view(lb, restarted)["routable"]
    assert restarted_answer(push(12, buckets[1], "step-2"))["weights_updated_fully"] is True
    assert_both_serve(cluster, lb, reference[12], "step-2")
    # a disk reload writes every weight at once
    restart_engine(lb, restarted)
    assert restarted_answer(push(11, buckets[0], "step-3"))["weights_updated_fully"] is False
    step3 = str(save_tiny(tmp_path / "step-3", tiny_weights(11)))
    r = lb.post("/update_weights_from_disk", json={"model_path": step3, "weight_version": "step-3"})
    assert r.status_code == 200, r.text
    assert_both_serve(cluster, lb, reference[11], "step-3")

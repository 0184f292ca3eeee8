"""Weight sync through the LB on real processes: a trainer (this test process, rank 0 of a gloo group) pushes
changed weights to two nodes; tensor pushes to chosen nodes; versions, pinning; failures that must leave no
node in a half-formed group; the router's worker APIs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import httpx
import pytest
import torch

from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.weight_sync import join_weight_group, serialize_named_tensors
from tests.support.procs import ServerProcess, wait_until
from tests.support.trainer import Trainer
from tests.support.weights import greedy, save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def weights() -> dict[str, dict[str, torch.Tensor]]:
    return {"old": tiny_weights(0), "new": tiny_weights(11)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, lb_args=("--health-interval", "0.2", "--health-timeout", "1"),
                       sidecar_args=("--engine-poll-interval", "0.2"), engine_args=("--weight-sync-timeout", "20"))
    with LocalCluster(spec, tmp_path_factory.mktemp("weight_sync")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, weights) -> Iterator[str]:
    """An engine loaded from a checkpoint of the new weights."""
    folder = save_tiny(tmp_path_factory.mktemp("new_ckpt"), weights["new"])
    proc = ServerProcess("node_engine", ["--model-path", str(folder)], log_dir=tmp_path_factory.mktemp("ref"))
    proc.start()
    yield proc.url
    proc.stop()


@pytest.fixture
def lb(cluster: LocalCluster, weights) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        yield client
        for proc in cluster.processes():
            if not proc.is_running():
                proc.start(timeout=60)
        wait_until(lambda: all(n["routable"] for n in client.get("/nodes").json()["nodes"]), timeout=30,
                   what="every node routable")
        r = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors(weights["old"].items())],
            "weight_version": "default"})
        assert r.status_code == 200, r.text


def test_a_trainer_pushes_new_weights_to_two_nodes_through_the_lb(cluster, lb, weights, reference) -> None:
    before = greedy(cluster.url)
    trainer = Trainer(cluster.url, world_size=3)
    r = trainer.join()
    assert r.status_code == 200, r.text
    assert r.json()["world_size"] == 3
    assert sorted(result["rank_offset"] for result in r.json()["results"]) == [1, 2]
    try:
        names = list(weights["new"])
        half = len(names) // 2
        r = trainer.push([(n, weights["new"][n]) for n in names[:half]], flush_cache=False)
        assert r.status_code == 200, r.text
        r = trainer.push([(n, weights["new"][n]) for n in names[half:]], flattened=True, weight_version="step-1")
        assert r.status_code == 200, r.text
        expected = greedy(reference)
        assert expected != before
        for node in cluster.nodes:  # each node serves the new weights, not only the one the LB picks
            assert greedy(node.url) == expected
        versions = lb.get("/get_weight_version").json()
        assert versions["weight_version"] == "step-1" and versions["consistent"] is True
        assert {n["weight_version"] for n in lb.get("/nodes").json()["nodes"]} == {"step-1"}
        # a wrong shape: every node refuses it (400), the old weights keep serving, the group stays in step
        name = names[3]
        r = trainer.push([(name, weights["old"][name][..., :-1].contiguous())])
        assert r.status_code == 502 and {f["status"] for f in r.json()["failures"]} == {400}, r.text
        assert all(greedy(node.url) == expected for node in cluster.nodes)
        # pinned generation: only nodes on that version take it
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        assert lb.post("/generate", json=body, headers={"X-Weight-Version": "step-1"}).status_code == 200
        r = lb.post("/generate", json=body, headers={"X-Weight-Version": "default"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "no_available_node" and r.headers["retry-after"]
    finally:
        assert trainer.leave().status_code == 200


def test_model_info_through_the_lb_and_the_sidecars_names_the_checkpoint_loaded(cluster, lb, weights,
                                                                               tmp_path: Path) -> None:
    """SGLang reports a successful reload's ``model_path`` (``tokenizer_manager.py:2365-2390``); so do the LB
    and each node's sidecar, which relay the engine's."""
    folder = str(save_tiny(tmp_path / "old_ckpt", weights["old"]))
    r = lb.post("/update_weights_from_disk", json={"model_path": folder})
    assert r.status_code == 200, r.text
    for path in ("/model_info", "/get_model_info"):
        assert lb.get(path).json()["model_path"] == folder
        assert {httpx.get(node.url + path, timeout=10).json()["model_path"] for node in cluster.nodes} == {folder}


def test_world_size_that_does_not_add_up_is_400_naming_the_right_one(cluster, lb) -> None:
    body = {**Trainer(cluster.url, world_size=2).init_body()}
    r = lb.post("/init_weights_update_group", json=body)
    assert r.status_code == 400 and r.json()["error"]["world_size"] == 3, r.text
    assert "world_size must be 3" in r.json()["error"]["message"]


def test_a_node_down_during_init_is_502_and_no_node_stays_in_the_group(cluster, lb) -> None:
    down = cluster.nodes[1]
    down.sidecar.stop()
    trainer = Trainer(cluster.url, world_size=3)
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=lb.post("/init_weights_update_group",
                                                                     json=trainer.init_body())))
    started = time.monotonic()
    thread.start()
    thread.join(60)
    r = answer["r"]
    assert r.status_code == 502, r.text
    failures = {f["node"]: f for f in r.json()["failures"]}
    up = cluster.nodes[0]
    assert failures[down.url]["reason"] == "unreachable"
    # the node that was waiting in its join was released by the rollback, not by the 20 s join timeout
    assert failures[up.url]["status"] == 409 and "abandoned" in failures[up.url]["detail"], failures
    assert r.json()["rolled_back"] and time.monotonic() - started < 15
    # it is in no group
    r = httpx.post(up.url + "/update_weights_from_distributed", json={
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}, timeout=30)
    assert r.status_code == 400 and "does not exist" in r.text, r.text


def test_a_trainer_that_never_joins_is_a_bounded_timeout(cluster, lb) -> None:
    trainer = Trainer(cluster.url, world_size=3)
    started = time.monotonic()
    r = lb.post("/init_weights_update_group", json=trainer.init_body(), params={"timeout": "3"})
    assert r.status_code == 502, r.text
    # every node timed out, or (its timer a moment behind the first one's) had its join abandoned by the rollback
    for failure in r.json()["failures"]:
        assert failure["reason"] == "timeout" or (failure.get("status") == 409
                                                  and "abandoned" in failure["detail"]), r.text
    assert "timeout" in {f["reason"] for f in r.json()["failures"]}, r.text
    assert time.monotonic() - started < 15 and r.json()["rolled_back"]  # the 3 s asked, not the engines' 20 s
    # nothing is left behind: the same group name joins at once with a trainer that does come
    trainer = Trainer(cluster.url, world_size=3)
    assert trainer.join().status_code == 200
    assert trainer.leave().status_code == 200


def test_tensor_pushes_go_to_the_nodes_named(cluster, lb, weights, reference) -> None:
    first, second = cluster.nodes
    payload = serialize_named_tensors(weights["new"].items())
    r = lb.post("/update_weights_from_tensor", params={"node": first.url},
                json={"serialized_named_tensors": [payload], "weight_version": "half"})
    assert r.status_code == 200 and [x["node"] for x in r.json()["results"]] == [first.url], r.text
    versions = lb.get("/get_weight_version").json()
    assert versions["consistent"] is False and versions["weight_version"] is None
    assert {v["node"]: v["weight_version"] for v in versions["nodes"]} == {first.url: "half", second.url: "default"}
    assert greedy(first.url) == greedy(reference) != greedy(second.url)
    r = lb.post("/update_weights_from_tensor", params={"node": "http://127.0.0.1:1"},
                json={"serialized_named_tensors": [payload]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "node_not_found"



def _shm_file(tensor: torch.Tensor) -> Path:
    """Where a tensor serialized with the ``file_system`` strategy lives (its storage is in shared memory now)."""
    _, handle, _ = tensor.untyped_storage()._share_filename_cpu_()
    return Path("/dev/shm") / handle.decode().lstrip("/")


def test_a_push_with_a_node_down_leaves_no_shared_memory_behind(cluster, lb, weights) -> None:
    """torch counts one reader per serialized tensor, and the LB lets one node release the sender's reference.
    It was always the first member: with that node down, nobody released it, and every push of the trainer left
    its tensors in /dev/shm until the trainer exited (a model's size per step). The releasing reader is a
    healthy node."""
    nodes = lb.get("/nodes").json()["nodes"]
    first = next(node for node in cluster.nodes if node.url == nodes[0]["url"])
    first.sidecar.stop()
    wait_until(lambda: any(n["url"] == first.url and n["health"] == "unhealthy" for n in lb.get("/nodes").json()[
        "nodes"]), timeout=30, what="the stopped node unhealthy")
    tensor = weights["new"]["model.norm.weight"].clone()
    payload = serialize_named_tensors([("model.norm.weight", tensor)])
    shm = _shm_file(tensor)
    r = lb.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
    assert r.status_code == 502 and [f["node"] for f in r.json()["failures"]] == [first.url], r.text
    assert len(r.json()["succeeded"]) == 1 and shm.exists()
    del tensor
    wait_until(lambda: not shm.exists(), timeout=10, what=f"{shm} unlinked once the sender let go")


def test_sglang_control_calls_fan_out(cluster, lb) -> None:
    r = lb.post("/update_weight_version", json={"new_version": "v-fanned"})
    assert r.status_code == 200 and r.json()["total"] == 2
    assert lb.get("/get_weight_version").json()["weight_version"] == "v-fanned"
    assert lb.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
    assert lb.post("/begin_weight_update", json={}).status_code == 200
    assert lb.post("/begin_weight_update", json={}).status_code == 502  # SGLang: one session at a time
    assert lb.post("/end_weight_update", json={}).status_code == 200
    for mode in ("retract", "in_place", "abort"):
        assert lb.post("/pause_generation", json={"mode": mode}).status_code == 200
        assert lb.post("/continue_generation", json={}).status_code == 200


def test_router_worker_apis_map_onto_membership(cluster, lb) -> None:
    node = cluster.nodes[1]
    assert lb.get("/list_workers").json() == {"urls": [n.url for n in cluster.nodes]}
    r = lb.post("/remove_worker", params={"url": node.url})
    assert r.status_code == 200 and r.text == f"Successfully removed worker: {node.url}"
    assert lb.post("/remove_worker", params={"url": node.url}).status_code == 200  # already gone: still 200
    assert lb.get("/list_workers").json()["urls"] == [cluster.nodes[0].url]
    assert lb.post("/add_worker", params={"url": node.url}).text == f"Successfully added worker: {node.url}"
    assert lb.post("/add_worker", params={"url": node.url}).status_code == 200  # idempotent
    workers = lb.get("/workers").json()
    assert workers["total"] == 2 and workers["stats"]["regular_count"] == 2
    [mine] = [w for w in workers["workers"] if w["url"] == node.url]
    assert mine["worker_type"] == "regular" and mine["id"].startswith("worker-")
    assert lb.delete(f"/workers/{mine['id']}").json()["success"] is True
    r = lb.post("/workers", json={"url": node.url, "worker_type": "regular"})
    assert r.status_code == 200 and r.json()["worker"]["url"] == node.url
    assert lb.delete(f"/workers/{quote(node.url, safe='')}").status_code == 200  # older routers: the URL
    assert lb.post("/workers", json={"url": node.url}).status_code == 200
    assert lb.post("/workers", json={"url": node.url, "worker_type": "decode"}).status_code == 409
    wait_until(lambda: all(n["routable"] for n in lb.get("/nodes").json()["nodes"]), timeout=30, what="routable")


def test_a_duplicate_init_leaves_the_live_group_alone(cluster, lb, weights) -> None:
    """Found by review: the rollback of a second init with the same name destroyed the first init's live
    group on every node. Now the nodes' 409s are left as they were and the live group keeps working."""
    trainer = Trainer(cluster.url, world_size=3)
    assert trainer.join().status_code == 200
    try:
        duplicate = Trainer(cluster.url, world_size=3)  # the same default group name, never joins
        r = lb.post("/init_weights_update_group", json=duplicate.init_body())
        assert r.status_code == 502 and {f["status"] for f in r.json()["failures"]} == {409}, r.text
        # a node still answering when the first 409 came was only asked to abandon a join: there was none
        assert all("nothing was destroyed" in rolled["body"]["message"] for rolled in r.json().get("rolled_back", []))
        name = "model.norm.weight"
        r = trainer.push([(name, weights["new"][name])])
        assert r.status_code == 200, r.text
    finally:
        assert trainer.leave().status_code == 200


def test_a_retried_init_is_refused_by_the_lb_and_the_first_goes_on(cluster, lb) -> None:
    """Found by review: a retry sent while the first init waited for its trainer made the LB roll back (abandon)
    the first one's joins. One init per group name at a time goes through the LB."""
    trainer = Trainer(cluster.url, world_size=3)
    first: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: first.update(r=lb.post("/init_weights_update_group",
                                                                    json=trainer.init_body())))
    thread.start()
    try:
        wait_until(lambda: all(trainer.group_name in httpx.get(node.url + "/get_server_info").json()[
            "weight_groups"]["joining"] for node in cluster.nodes), timeout=10, what="the first init's joins")
        r = lb.post("/init_weights_update_group", json=trainer.init_body())
        assert r.status_code == 409 and "already under way" in r.json()["error"]["message"], r.text
        trainer.group = join_weight_group(master_address="127.0.0.1", master_port=trainer.port, rank=0,
                                          world_size=3, group_name=trainer.group_name, backend="gloo", timeout_s=30)
    finally:
        thread.join(60)
    assert first["r"].status_code == 200, first["r"].text
    assert trainer.leave().status_code == 200


def test_an_abandoned_join_stops_and_never_pairs_with_a_later_trainer(tmp_path: Path) -> None:
    """Found by review: a join abandoned by destroy_weights_update_group kept waiting for the trainer's store
    until --weight-sync-timeout, so a trainer that came back on the same port paired with the stale join (its
    broadcasts then failed), and four such threads blocked every reload and push."""
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--weight-sync-timeout", "60"],
                         log_dir=tmp_path)
    proc.start()
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as client:
            trainer = Trainer(proc.url, world_size=2, group_name="g")
            for _ in range(5):  # more than the four stuck threads that once blocked everything
                answer: dict[str, httpx.Response] = {}
                thread = threading.Thread(target=lambda: answer.update(
                    r=client.post("/init_weights_update_group", json=trainer.init_body())))
                thread.start()
                wait_until(lambda: "g" in client.get("/get_server_info").json()["weight_groups"]["joining"],
                           timeout=10, what="the join under way")
                assert client.post("/destroy_weights_update_group", json={"group_name": "g"}).status_code == 200
                thread.join(30)
                assert answer["r"].status_code == 409 and "abandoned" in answer["r"].text
            # the trainer comes up on the port every abandoned join waited for: only a new join pairs with it
            r = trainer.join(timeout_s=20)
            assert r.status_code == 200, r.text
            name = "model.norm.weight"
            r = trainer.push([(name, tiny_weights(3)[name])])
            assert r.status_code == 200, r.text
            assert trainer.leave().status_code == 200
            r = client.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [serialize_named_tensors(tiny_weights(0).items())]})
            assert r.status_code == 200, r.text
    finally:
        proc.stop()


def test_a_push_with_a_bad_release_flag_is_refused_by_every_node(cluster, lb, weights) -> None:
    """The LB rewrites ``release_sender_reference`` to false for all nodes but one; a value that is no boolean was
    replaced for those nodes, so one node refused the push (400) and the others loaded it: a 502 and a half-updated
    cluster for a body that is simply invalid."""
    before = [greedy(node.url) for node in cluster.nodes]
    payload = serialize_named_tensors(weights["new"].items())
    r = lb.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "weight_version": "bad",
                                                     "release_sender_reference": "no"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert [greedy(node.url) for node in cluster.nodes] == before
    assert {v["weight_version"] for v in lb.get("/get_weight_version").json()["nodes"]} == {"default"}

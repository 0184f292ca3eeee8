"""SGLang's /weights_checker through the LB and the sidecars on real processes: slime's
``--check-weight-update-equal`` sequence (snapshot, reset_tensors, compare fails naming tensors, a reload of the
original checkpoint, compare passes), checksums (stable, changed by an update), a bad action, released weights,
and the LB's fan-out answer per node."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster
from tests.support.procs import wait_until
from tests.support.weights import greedy, save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint the engines start with (``builtin:tiny``, seed 0)."""
    return save_tiny(tmp_path_factory.mktemp("original"), tiny_weights(0))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, lb_args=("--health-interval", "0.2", "--health-timeout", "1"),
                       sidecar_args=("--engine-poll-interval", "0.2"))
    with LocalCluster(spec, tmp_path_factory.mktemp("weights_checker")) as c:
        yield c


@pytest.fixture
def lb(cluster: LocalCluster, original: Path) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        yield client
        r = client.post("/update_weights_from_disk", json={"model_path": str(original)})
        assert r.status_code == 200, r.text
        wait_until(lambda: all(n["routable"] for n in client.get("/nodes").json()["nodes"]), timeout=30,
                   what="every node routable")


def _bodies(answer: dict) -> list[dict]:
    return [result["body"] for result in answer["results"]]


def test_slimes_check_weight_update_equal_sequence(cluster, lb, original) -> None:
    before = greedy(cluster.url)
    r = lb.post("/weights_checker", json={"action": "snapshot"})
    assert r.status_code == 200, r.text
    assert r.json()["total"] == 2
    assert _bodies(r.json()) == [{"success": True, "message": "Success."}] * 2
    r = lb.post("/weights_checker", json={"action": "reset_tensors"})
    assert r.status_code == 200, r.text
    # the weights are garbage until the next update: no node serves them
    for node in cluster.nodes:
        r = httpx.post(node.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                       timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "weights_not_loaded"
    r = lb.post("/weights_checker", json={"action": "compare"})
    assert r.status_code == 502, r.text
    answer = r.json()
    assert answer["failed"] == 2 and answer["error"]["type"] == "fanout_failed"
    for failure in answer["failures"]:
        assert failure["status"] == 400
        assert "check tensor equality failed:" in failure["detail"] and "name=" in failure["detail"]
    # one node's own answer in full: SGLang's, naming every tensor that differs
    r = httpx.post(cluster.nodes[0].url + "/weights_checker", json={"action": "compare"}, timeout=30)
    assert r.status_code == 400
    assert r.json()["success"] is False and list(r.json()) == ["success", "message"]
    assert "name=lm_head_weight max_abs_err=" in r.json()["message"]
    assert "name=model.layers.0.self_attn.qkv_proj.weight " in r.json()["message"]
    r = lb.post("/update_weights_from_disk", json={"model_path": str(original)})
    assert r.status_code == 200, r.text
    r = lb.post("/weights_checker", json={"action": "compare"})
    assert r.status_code == 200, r.text
    assert _bodies(r.json()) == [{"success": True, "message": "Success."}] * 2
    wait_until(lambda: all(n["routable"] for n in lb.get("/nodes").json()["nodes"]), timeout=30,
               what="every node routable")
    assert greedy(cluster.url) == before


def test_checksums_are_stable_and_follow_an_update(cluster, lb, tmp_path: Path) -> None:
    node = cluster.nodes[0].url
    first = httpx.get(node + "/weights_checker", timeout=30)  # GET, no body: a checksum, as SGLang
    assert first.status_code == 200, first.text
    answer = first.json()
    assert list(answer) == ["success", "message", "ranks", "per_engine_checksum"]
    [rank] = answer["ranks"]
    assert rank["parallelism_info"][0]["role"] == "target"
    assert answer["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    again = httpx.post(node + "/weights_checker", json={"action": "checksum"}, timeout=30)
    assert again.json() == answer
    r = lb.get("/weights_checker")  # fanned out: every node holds the same weights
    assert r.status_code == 200, r.text
    assert {b["per_engine_checksum"] for b in _bodies(r.json())} == {answer["per_engine_checksum"]}
    r = lb.post("/update_weights_from_disk", json={"model_path": str(save_tiny(tmp_path, tiny_weights(11)))})
    assert r.status_code == 200, r.text
    changed = httpx.post(node + "/weights_checker", json={}, timeout=30).json()
    assert changed["per_engine_checksum"] != answer["per_engine_checksum"]
    assert changed["ranks"][0]["checksums"].keys() == rank["checksums"].keys()


def test_a_bad_action_is_sglangs_400_on_each_node(cluster, lb) -> None:
    r = httpx.post(cluster.nodes[1].url + "/weights_checker", json={"action": "bogus"}, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"success": False, "message": "Unsupported action='bogus'"}
    r = lb.post("/weights_checker", json={"action": "bogus"})
    assert r.status_code == 502
    assert sorted(f["node"] for f in r.json()["failures"]) == sorted(n.url for n in cluster.nodes)
    assert {f["status"] for f in r.json()["failures"]} == {400}
    r = lb.post("/weights_checker", json={"action": 5})
    assert r.status_code == 502
    assert {f["status"] for f in r.json()["failures"]} == {400}


def test_released_weights_are_refused(cluster, lb) -> None:
    node = cluster.nodes[0].url
    r = httpx.post(node + "/release_memory_occupation", json={"tags": ["weights"]}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        r = httpx.post(node + "/weights_checker", json={"action": "snapshot"}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "memory_released"
    finally:
        r = httpx.post(node + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=30)
        assert r.status_code == 200, r.text

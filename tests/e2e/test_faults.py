"""Fault injection on a whole cluster (issue 8): real processes killed, restarted and starved on loopback.

One module-scoped cluster (LB + 2 nodes, fast health checks); every test leaves
every process running, every node resident and serving, and no drill file set.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from handoff.client import FanoutFailed, HandoffClient
from handoff.cluster.local import ClusterSpec, LocalCluster, NodeProcesses
from handoff.weight_sync import serialize_named_tensors
from tests.support.procs import wait_until
from tests.support.streams import GenerationClient
from tests.support.weights import greedy, save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(90)

ALL = ["weights", "kv_cache", "cuda_graph", "workspace"]
SHORT = {"text": "short", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


def long_stream(num_tokens: int = 4000) -> dict[str, Any]:
    return {"text": "a long stream", "stream": True,
            "sampling_params": {"max_new_tokens": num_tokens, "ignore_eos": True, "temperature": 0.8}}


@pytest.fixture(scope="module")
def drill_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """node0's engine reads its free memory from here while the file holds a number."""
    path = tmp_path_factory.mktemp("drill") / "node0-free-bytes"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, drill_file: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_mixed=2, weights_backup="disk", free_memory_override_files=(str(drill_file),),
                       lb_args=("--health-interval", "0.2", "--health-timeout", "1"),
                       sidecar_args=("--engine-poll-interval", "0.2"))
    with LocalCluster(spec, tmp_path_factory.mktemp("faults")) as c:
        yield c


@pytest.fixture
def lb(cluster: LocalCluster, drill_file: Path) -> Iterator[HandoffClient]:
    with HandoffClient(cluster.url, timeout=60) as client:
        yield client
        drill_file.write_text("")
        for proc in cluster.processes():
            if not proc.is_running():
                proc.start(timeout=60)
        wait_until(lambda: all(n["health"] == "healthy" for n in client.nodes()), timeout=30, what="all healthy")
        client.resume()
        wait_until(lambda: all(n["routable"] for n in client.nodes()), timeout=30, what="all routable")


def lb_view(lb: HandoffClient, node: NodeProcesses) -> dict[str, Any]:
    return next(n for n in lb.nodes() if n["url"] == node.url)


def occupation(node: NodeProcesses) -> dict[str, Any]:
    return httpx.get(node.url + "/memory_occupation", timeout=10).json()


def the_node_streaming(cluster: LocalCluster, lb: HandoffClient) -> tuple[NodeProcesses, NodeProcesses]:
    """(the node the LB sent the one stream in flight to, the other one)."""
    busy = wait_until(lambda: [n for n in cluster.nodes if lb_view(lb, n)["in_flight"] == 1], timeout=10,
                      what="the stream to reach a node")
    [victim] = busy
    return victim, next(n for n in cluster.nodes if n is not victim)


def test_engine_killed_mid_stream(cluster: LocalCluster, lb: HandoffClient) -> None:
    stream = GenerationClient(cluster.url + "/generate", long_stream())
    stream.start()
    assert stream.started_streaming.wait(10)
    victim, other = the_node_streaming(cluster, lb)
    victim.engine.kill()
    result = stream.finish(20)
    # through the LB: the stream's last event is the sidecar's error, never a silent cut
    assert result.status == 200 and result.events[-1]["error"]["type"] == "engine_unavailable", result
    refused = httpx.post(victim.url + "/generate", json=SHORT, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_unavailable"
    assert refused.headers["retry-after"]
    control = httpx.post(victim.url + "/flush_cache", timeout=10)
    assert control.status_code == 503 and control.json()["error"]["type"] == "engine_unavailable"
    assert httpx.get(victim.url + "/health", timeout=10).status_code == 200  # the sidecar itself is alive
    wait_until(lambda: not lb_view(lb, victim)["routable"], timeout=10, what="the LB to stop routing there")
    for _ in range(4):  # the cluster keeps serving on the other node
        assert lb.generate(**SHORT)["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(FanoutFailed) as info:  # a fan-out names the dead engine's node
        lb.flush_cache()
    assert info.value.failed_nodes == [victim.url] and [s.node for s in info.value.succeeded] == [other.url]
    assert info.value.failures[0]["status"] == 503 and "engine_unavailable" in info.value.failures[0]["detail"]
    victim.engine.start(timeout=60)  # the same port: the sidecar finds it again
    wait_until(lambda: lb_view(lb, victim)["routable"], timeout=30, what="the node to serve again")
    assert httpx.post(victim.url + "/generate", json=SHORT, timeout=30).status_code == 200


def test_engine_killed_mid_release(cluster: LocalCluster, lb: HandoffClient) -> None:
    # one stream on each node, so that the release has something to drain everywhere
    streams = [GenerationClient(cluster.url + "/generate", long_stream(num_tokens)) for num_tokens in (4000, 1500)]
    streams[0].start()
    assert streams[0].started_streaming.wait(10)
    victim, other = the_node_streaming(cluster, lb)
    streams[1].start()
    assert streams[1].started_streaming.wait(10)
    wait_until(lambda: lb_view(lb, other)["in_flight"] == 1, timeout=10, what="a stream on the other node")
    outcome: dict[str, Any] = {}

    def release() -> None:
        try:
            outcome["answer"] = lb.release(mode="wait", stage_to_cpu=True, drain_timeout=30, timeout=60)
        except FanoutFailed as exc:
            outcome["error"] = exc

    releasing = threading.Thread(target=release)
    releasing.start()
    wait_until(lambda: occupation(victim)["admission"] == "closed", timeout=10, what="the victim's drain")
    victim.engine.kill()
    releasing.join(60)
    exc = outcome["error"]
    # the 502 names the node that failed and lists the other one as succeeded, with what it did
    assert exc.failed_nodes == [victim.url] and exc.failures[0]["status"] == 503
    assert "engine_unavailable" in exc.failures[0]["detail"]
    [succeeded] = exc.succeeded
    assert succeeded.node == other.url and succeeded.body["released"] == ALL
    assert succeeded.body["drained_requests"] == 1
    assert streams[0].finish(20).events[-1]["error"]["type"] == "engine_unavailable"
    drained = streams[1].finish(20)
    assert drained.saw_done and drained.finish_reason == "length" and drained.num_tokens == 1500
    assert occupation(victim)["engine_reachable"] is False
    victim.engine.start(timeout=60)
    wait_until(lambda: lb_view(lb, victim)["routable"], timeout=30, what="the victim to serve again")
    # the same call again completes the job: nodes are idempotent
    bodies = lb.release(mode="wait", stage_to_cpu=True).bodies()
    assert bodies[victim.url]["released"] == ALL and bodies[other.url]["already_released"] == ALL
    # a crash while released: the fresh engine starts with everything resident; the sidecar, which remembers that
    # the cluster released the node, releases it again before admitting anything, and the LB keeps it unroutable
    victim.engine.kill()
    wait_until(lambda: occupation(victim)["engine_reachable"] is False, timeout=10, what="the engine seen down")
    victim.engine.start(timeout=60)
    wait_until(lambda: occupation(victim)["engine_reachable"] and all(
        t["state"] == "released" for t in occupation(victim)["tags"].values()), timeout=30,
        what="the fresh engine released again")
    engine_view = httpx.get(victim.engine.url + "/memory_occupation", timeout=10).json()
    assert {tag: t["state"] for tag, t in engine_view["tags"].items()} == dict.fromkeys(ALL, "released")
    wait_until(lambda: lb_view(lb, victim)["health"] == "healthy" and all(
        t["state"] == "released" for t in lb_view(lb, victim)["tags"].values()), timeout=10, what="the LB to see it")
    assert not lb_view(lb, victim)["routable"] and lb_view(lb, victim)["not_serving_reason"] == "node_released"
    refused = httpx.post(victim.url + "/generate", json=SHORT, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "node_released"
    bodies = lb.resume().bodies()  # the cluster's resume brings both back, as after any release
    assert bodies[victim.url]["resumed"] == ALL and bodies[other.url]["resumed"] == ALL
    assert lb_view(lb, victim)["routable"]


def restart_engine(node: NodeProcesses) -> None:
    """Kill the node's engine, wait for its sidecar to see it down, start a fresh one on the same port."""
    node.engine.kill()
    wait_until(lambda: occupation(node)["engine_reachable"] is False, timeout=10, what="the engine seen down")
    node.engine.start(timeout=60)
    wait_until(lambda: occupation(node)["engine_reachable"] and occupation(node)["tags"]["weights"]["state"]
               != "unknown", timeout=30, what="the fresh engine read")


def push_tensors(node: NodeProcesses, seed: int, version: str) -> httpx.Response:
    payload = serialize_named_tensors(tiny_weights(seed).items())
    return httpx.post(node.url + "/update_weights_from_tensor", timeout=60,
                      json={"serialized_named_tensors": [payload], "weight_version": version})


def test_engine_restarted_with_nothing_changed_serves_at_once(cluster: LocalCluster, lb: HandoffClient) -> None:
    node = cluster.nodes[0]
    restart_engine(node)
    wait_until(lambda: occupation(node)["serving"], timeout=10, what="the node to serve")
    assert occupation(node)["not_serving_reason"] is None and occupation(node)["weight_version"] == "default"
    assert httpx.post(node.url + "/generate", json=SHORT, timeout=30).status_code == 200


@pytest.mark.parametrize("update", ["tensor", "disk"])
def test_engine_restarted_after_a_weight_update_serves_no_stale_weights(
        cluster: LocalCluster, lb: HandoffClient, tmp_path: Path, update: str) -> None:
    node, other = cluster.nodes
    start_answer = greedy(node.url)
    checkpoint = str(save_tiny(tmp_path / "step-1", tiny_weights(11)))
    if update == "tensor":
        assert push_tensors(node, 11, "step-1").status_code == 200
    else:
        r = httpx.post(node.url + "/update_weights_from_disk", timeout=60,
                       json={"model_path": checkpoint, "weight_version": "step-1"})
        assert r.status_code == 200, r.text
    updated_answer = greedy(node.url)
    assert updated_answer != start_answer and occupation(node)["weight_version"] == "step-1"
    restart_engine(node)
    # the fresh engine serves its start checkpoint ("default"): the node refuses it, naming both versions
    view = occupation(node)
    assert view["serving"] is False and view["not_serving_reason"] == "weights_stale", view
    assert view["weight_version"] == "default" and "'step-1'" in view["last_error"]
    refused = httpx.post(node.url + "/generate", json=SHORT, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "weights_stale"
    assert "'default'" in refused.json()["error"]["message"] and refused.headers["retry-after"]
    wait_until(lambda: lb_view(lb, node)["health"] == "healthy" and lb_view(lb, node)["weight_version"]
               == "default", timeout=10, what="the LB to see the fresh engine")
    assert not lb_view(lb, node)["routable"] and lb_view(lb, node)["not_serving_reason"] == "weights_stale"
    assert lb_view(lb, other)["routable"]
    for _ in range(3):  # the LB serves from the other node
        assert lb.generate(**SHORT)["meta_info"]["finish_reason"]["type"] == "length"
    # a rename labels the stale weights, it does not replace them: still not serving
    r = httpx.post(node.url + "/update_weight_version", json={"new_version": "step-1"}, timeout=30)
    assert r.status_code == 200 and occupation(node)["not_serving_reason"] == "weights_stale"
    # the trainer's next update (the other kind here) ends it
    if update == "tensor":
        r = httpx.post(node.url + "/update_weights_from_disk", timeout=60,
                       json={"model_path": checkpoint, "weight_version": "step-2"})
        assert r.status_code == 200, r.text
    else:
        assert push_tensors(node, 11, "step-2").status_code == 200
    view = occupation(node)
    assert view["serving"] is True and view["weight_version"] == "step-2" and view["not_serving_reason"] is None
    assert greedy(node.url) == updated_answer
    wait_until(lambda: lb_view(lb, node)["routable"], timeout=10, what="the LB to route there again")
    # as the module found it: a fresh engine on its start checkpoint behind a fresh sidecar (which knows of no update)
    node.sidecar.stop()
    node.engine.kill()
    node.engine.start(timeout=60)
    node.sidecar.start(timeout=60)
    wait_until(lambda: lb_view(lb, node)["routable"], timeout=30, what="the fresh node routable")
    assert occupation(node)["weight_version"] == "default"


def without_memory_saver(args: list[str]) -> list[str]:
    """An engine's arguments less the memory saver and the weights backup that needs it."""
    out, skip = [], False
    for arg in args:
        if skip or arg == "--enable-memory-saver":
            skip = False
        elif arg in ("--weights-backup", "--backup-dir"):
            skip = True
        else:
            out.append(arg)
    return out


def test_a_fresh_engine_that_cannot_be_released_again_does_not_serve(cluster: LocalCluster,
                                                                     lb: HandoffClient) -> None:
    node = cluster.nodes[0]
    r = httpx.post(node.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert r.status_code == 200 and r.json()["released"] == ["kv_cache", "workspace"]
    args = list(node.engine.args)
    node.engine.args = without_memory_saver(args)  # restarted with the wrong flags
    try:
        restart_engine(node)
        wait_until(lambda: "releasing them again failed" in (occupation(node)["last_error"] or ""), timeout=10,
                   what="the failed re-release")
        view = occupation(node)
        assert view["serving"] is False and view["not_serving_reason"] == "node_released", view
        assert view["tags"]["kv_cache"]["state"] == "resident" and "memory saver" in view["last_error"]
        refused = httpx.post(node.url + "/generate", json=SHORT, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "node_released"
        assert refused.json()["error"]["released"] == ["kv_cache", "workspace"]
        wait_until(lambda: lb_view(lb, node)["not_serving_reason"] == "node_released", timeout=10,
                   what="the LB to see it")
        assert not lb_view(lb, node)["routable"]
        # the cluster's resume settles it: the cluster wants the node resident again
        r = httpx.post(node.url + "/resume_memory_occupation", json={}, timeout=30)
        assert r.status_code == 200 and r.json()["resumed"] == [] and r.json()["serving"] is True
    finally:
        node.engine.args = args
    restart_engine(node)  # as the module found it
    wait_until(lambda: occupation(node)["serving"], timeout=10, what="the node to serve")


def record_state(node: NodeProcesses) -> str | None:
    """The sidecar's kv_cache state once it is known; asserts it is never a guess in the meantime."""
    state = occupation(node)["tags"]["kv_cache"]["state"]
    assert state in ("unknown", "released"), state
    return None if state == "unknown" else state


def test_sidecar_restarted_while_the_lb_polls_it(cluster: LocalCluster, lb: HandoffClient) -> None:
    node, other = cluster.nodes
    # a state only the engine knows after the restart: node's kv_cache released behind the LB's back
    assert httpx.post(node.url + "/release_memory_occupation", json={"tags": ["kv_cache"]},
                      timeout=30).status_code == 200
    node.sidecar.stop()
    wait_until(lambda: lb_view(lb, node)["health"] == "unhealthy", timeout=10, what="the LB to see it down")
    assert "cannot connect" in lb_view(lb, node)["last_error"]
    for _ in range(4):
        assert lb.generate(**SHORT)["meta_info"]["finish_reason"]["type"] == "length"
    node.sidecar.start(timeout=60)  # same port
    # the new sidecar knows nothing until it has read the engine: never "resident" for the released tag
    seen = wait_until(lambda: record_state(node), timeout=10, what="the new sidecar to read its engine")
    assert seen == "released"
    wait_until(lambda: lb_view(lb, node)["health"] == "healthy" and lb_view(lb, node)["tags"]["kv_cache"]["state"]
               != "unknown", timeout=10, what="the LB to see it back")
    view = lb_view(lb, node)
    assert view["tags"]["kv_cache"]["state"] == "released" and view["tags"]["weights"]["state"] == "resident"
    assert not view["routable"]
    bodies = lb.resume().bodies()
    assert bodies[node.url]["resumed"] == ["kv_cache", "workspace"] and bodies[other.url]["resumed"] == []
    assert lb_view(lb, node)["routable"]


def test_lb_restarted_while_the_nodes_are_released(cluster: LocalCluster, lb: HandoffClient) -> None:
    lb.release(mode="abort", stage_to_cpu=True)
    assert cluster.lb is not None
    cluster.lb.stop()
    cluster.lb.start(timeout=30)  # same port, no memory of the release: it asks the nodes
    with HandoffClient(cluster.url, timeout=60) as fresh:
        views = fresh.nodes()
        assert [v["health"] for v in views] == ["healthy", "healthy"]
        assert not any(v["routable"] for v in views)
        assert all(t["state"] == "released" for v in views for t in v["tags"].values())
        refused = httpx.post(cluster.url + "/generate", json=SHORT, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "no_available_node"
        assert int(refused.headers["retry-after"]) >= 1
        assert fresh.resume().total == 2
        assert all(v["routable"] for v in fresh.nodes())
        assert fresh.generate(**SHORT)["meta_info"]["finish_reason"]["type"] == "length"


def test_resume_with_too_little_memory_on_one_node(cluster: LocalCluster, lb: HandoffClient,
                                                   drill_file: Path) -> None:
    starved, other = cluster.nodes
    lb.release(stage_to_cpu=True)
    drill_file.write_text("1000")  # node0's engine now sees 1000 free bytes
    with pytest.raises(FanoutFailed) as info:
        lb.resume()
    [failure] = info.value.failures
    assert failure["node"] == starved.url and failure["status"] == 507
    error = json.loads(failure["detail"])["error"]
    assert error["type"] == "insufficient_memory" and error["free_bytes"] == 1000 and error["needed_bytes"] > 1000
    [succeeded] = info.value.succeeded
    assert succeeded.node == other.url and succeeded.body["resumed"] == ALL
    # nothing changed on the starved node; the cluster serves on the other
    assert all(t["state"] == "released" for t in lb_view(lb, starved)["tags"].values())
    assert lb_view(lb, other)["routable"] and not lb_view(lb, starved)["routable"]
    assert lb.generate(**SHORT)["meta_info"]["finish_reason"]["type"] == "length"
    drill_file.write_text("")  # memory is back
    bodies = lb.resume().bodies()
    assert bodies[starved.url]["resumed"] == ALL and bodies[starved.url]["weights_valid"] is True
    assert bodies[other.url]["already_resident"] == ALL
    assert all(v["routable"] for v in lb.nodes())

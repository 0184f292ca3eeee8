"""The sidecar in front of SGLang: its contract, against the SGLang stand-in (``tests/support/sglang_fake.py``).

Every call the fake would die of (a release while busy, a second release of a
tag, a resume of a tag that is not released, a generation or ``/health`` while
released) is one the sidecar must never send; each test ends by checking the
fake is still alive. This path has not run against a real SGLang (it needs a
GPU): the fake reproduces SGLang 0.5.23's behaviours from its source.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest

from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.support.procs import ServerProcess, wait_until
from tests.support.streams import GenerationClient, SteadyLoad, start_clients

SGLANG_TAGS = ["kv_cache", "weights", "cuda_graph"]
RELEASE_ORDER = ["weights", "kv_cache", "cuda_graph"]  # the sidecar names tags in the SPEC's order
ALL = ["weights", "kv_cache", "cuda_graph", "workspace"]
TAG_MIB = 24


class Node:
    """A fake SGLang and a sidecar in front of it."""

    def __init__(self, log_dir: Path, *fake_flags: str, sidecar_flags: tuple[str, ...] = ()) -> None:
        self.fake = ServerProcess("tests.support.sglang_fake", ["--tag-mib", str(TAG_MIB), *fake_flags],
                                  log_dir=log_dir, name="sglang", health_path="/model_info").start()
        self.sidecar = ServerProcess("node_sidecar", ["--engine-url", self.fake.url, "--engine-poll-interval", "0.2",
                                                      *sidecar_flags], log_dir=log_dir, name="sidecar").start()
        self.wait_serving()

    def wait_serving(self) -> None:
        wait_until(lambda: httpx.get(self.sidecar.url + "/ready").status_code == 200, timeout=20,
                   what="sidecar ready")

    def post(self, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
        return httpx.post(self.sidecar.url + path, json={} if body is None else body, timeout=60, **kwargs)

    def occupation(self) -> dict:
        return httpx.get(self.sidecar.url + "/memory_occupation", timeout=10).json()

    def fake_state(self) -> dict:
        return httpx.get(self.fake.url + "/_fake/state", timeout=10).json()

    def assert_fake_alive(self) -> None:
        assert self.fake.is_running(), self.fake.log_tail()
        assert httpx.get(self.fake.url + "/model_info", timeout=5).status_code == 200

    def stop(self) -> None:
        self.sidecar.stop()
        self.fake.stop()


@pytest.fixture
def make_node(proc_log_dir: Path):
    nodes: list[Node] = []

    def make(*fake_flags: str, sidecar_flags: tuple[str, ...] = ()) -> Node:
        nodes.append(Node(proc_log_dir, *fake_flags, sidecar_flags=sidecar_flags))
        return nodes[-1]

    yield make
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    arch = builtin_arch("builtin:tiny")
    save_checkpoint(folder, arch, builtin_weights(arch, 0))
    return folder


def stream_body(max_new_tokens: int) -> dict:
    return {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens}}


def greedy(node: Node) -> list[int]:
    r = node.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_kind_detected_release_drains_and_names_only_resident_sglang_tags(make_node) -> None:
    node = make_node("--enable-memory-saver")
    assert node.occupation()["engine_kind"] == "sglang"
    clients = start_clients(node.sidecar.url + "/generate", stream_body(60), 4)
    wait_until(lambda: node.occupation()["in_flight"] == 4, timeout=10, what="4 streams in flight")
    r = node.post("/release_memory_occupation", {"mode": "wait"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["released"] == ALL and body["drained_requests"] == 4
    # measured, not assumed: the fake's three regions went back to the OS
    assert body["bytes_measured_by"] == "process_rss"
    assert body["bytes_freed"]["weights+kv_cache+cuda_graph"] > 2.5 * TAG_MIB * 2 ** 20
    for c in clients:
        result = c.finish(30)
        assert result.saw_done and result.events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # released: generation gets the 503 and never reaches SGLang; the liveness poll does not generate either
    r = node.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "node_released"
    polls = node.fake_state()["num_model_info"]
    wait_until(lambda: node.fake_state()["num_model_info"] >= polls + 3, timeout=10, what="3 liveness polls")
    calls = node.fake_state()["calls"]
    assert "health" not in calls and "generate" not in calls[calls.index(f"release {RELEASE_ORDER}"):]
    node.assert_fake_alive()
    assert node.fake_state()["offload_tags"] == sorted(SGLANG_TAGS) and node.fake_state()["regions"] == []


def test_abort_release_ends_streams_with_sglang_abort_finish_reasons(make_node) -> None:
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    clients = start_clients(node.sidecar.url + "/generate", stream_body(2000), 3)
    for c in clients:
        assert c.started_streaming.wait(10)
    r = node.post("/release_memory_occupation", {"mode": "abort", "tags": ["kv_cache"]})
    assert r.status_code == 200, r.text
    # the workspace follows kv_cache (handoff's tag rule); SGLang itself is asked for kv_cache alone
    assert r.json()["aborted_requests"] == 3 and r.json()["released"] == ["kv_cache", "workspace"]
    for c in clients:
        result = c.finish(30)
        assert result.saw_done and result.events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(result.events[-1]["output_ids"]) < 2000
    assert node.fake_state()["offload_tags"] == ["kv_cache"]
    node.assert_fake_alive()


def test_repeated_release_and_resume_are_no_ops_that_never_reach_sglang(make_node) -> None:
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    before = greedy(node)
    released = node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).json()["released"]
    assert released == ["kv_cache", "workspace"]  # the workspace follows kv_cache
    again = node.post("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}).json()
    assert again["released"] == ["weights"] and again["already_released"] == ["kv_cache", "workspace"]
    nothing = node.post("/release_memory_occupation", {"tags": []}).json()
    assert nothing["released"] == [] and nothing["already_released"] == []
    assert node.post("/release_memory_occupation", {"tags": ALL}).json()["already_released"] == [
        "weights", "kv_cache", "workspace"]
    first = node.post("/resume_memory_occupation", {"tags": ["kv_cache", "workspace"]}).json()
    assert first["resumed"] == ["kv_cache", "workspace"] and first["already_resident"] == []
    rest = node.post("/resume_memory_occupation", {"tags": None}).json()
    assert rest["resumed"] == ["weights", "cuda_graph"] and rest["already_resident"] == ["kv_cache", "workspace"]
    assert node.post("/resume_memory_occupation", {}).json()["already_resident"] == ALL
    # SGLang saw each tag released once and resumed once, never an empty list (which would mean every tag)
    calls = [c for c in node.fake_state()["calls"] if c.startswith(("release", "resume"))]
    assert calls == ["release ['kv_cache']", "release ['weights']", "release ['cuda_graph']",
                     "resume ['kv_cache']", "resume ['weights', 'cuda_graph']"]
    node.assert_fake_alive()
    assert node.occupation()["weights_valid"] is True and greedy(node) == before  # the CPU backup kept them


def test_weights_without_backup_refuse_generation_until_a_reload(make_node, checkpoint: Path) -> None:
    node = make_node("--enable-memory-saver")
    before = greedy(node)
    assert node.post("/release_memory_occupation", {"stage_to_cpu": True}).json()["error"]["type"] == \
        "no_weights_backup"
    assert node.post("/release_memory_occupation").status_code == 200
    resumed = node.post("/resume_memory_occupation").json()
    assert resumed["weights_valid"] is False and resumed["serving"] is False
    r = node.post("/generate", {"input_ids": [5, 6, 7]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weights_not_loaded"
    assert node.fake_state()["weights_garbage"] is True  # what SGLang would have served
    reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": "step-2"})
    assert reload.status_code == 200, reload.text
    assert reload.json()["weight_version"] == "step-2" and reload.json()["serving"] is True
    assert greedy(node) == before and node.occupation()["weight_version"] == "step-2"
    node.assert_fake_alive()


def test_reload_while_weights_released_resumes_them_first(make_node, checkpoint: Path) -> None:
    node = make_node("--enable-memory-saver")
    assert node.post("/release_memory_occupation").status_code == 200
    wait_until(lambda: node.fake_state()["running"] == 0, timeout=10, what="the last batch let go")  # else the
    # flush after the load is refused
    reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoint)})
    assert reload.status_code == 200, reload.text
    assert reload.json()["resumed"] == ["weights"]
    tags = node.occupation()["tags"]
    assert tags["weights"]["state"] == "resident" and tags["kv_cache"]["state"] == "released"
    assert node.post("/resume_memory_occupation").json()["resumed"] == ["kv_cache", "cuda_graph", "workspace"]
    assert node.occupation()["serving"] is True and node.occupation()["weights_valid"] is True
    node.assert_fake_alive()


def test_a_reload_right_after_the_drain_waits_for_sglang_to_be_idle(make_node, checkpoint: Path) -> None:
    """SGLang flushes after a load and fails the update when not idle, as it is for one loop iteration after the
    last answer: a reload sent the moment the drain ended loaded, was refused (400 "Weights were updated, but the
    cache was not flushed") and took the node out until another reload. It waits for SGLang to be idle first."""
    node = make_node("--enable-memory-saver", "--model-path", str(checkpoint))
    running = start_clients(node.sidecar.url + "/generate", stream_body(50), 1)
    wait_until(lambda: node.occupation()["in_flight"] == 1, timeout=10, what="a request running")
    reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": "v2"})
    assert running[0].finish(30).saw_done
    assert reload.status_code == 200 and reload.json()["drained_requests"] == 1, reload.text
    assert node.occupation()["serving"] is True and node.occupation()["weight_version"] == "v2"
    node.assert_fake_alive()


def test_an_update_is_sent_even_when_sglang_stays_busy_flushed_after_and_recorded(make_node,
                                                                                   checkpoint: Path) -> None:
    """An update that flushes waited for SGLang to be idle before it was sent, and was refused (409, nothing
    loaded) when SGLang stayed busy: for a broadcast, the trainer's group then had no receiver on this node. The
    update is sent with ``flush_cache: false`` and the flush asked after it: a 409 says the weights are updated.
    That 409 was then recorded as a failure: the node's intent kept no update, and an SGLang restarted after it
    served its start checkpoint as the new weights; now a fresh SGLang is ``weights_stale``. A request sent to
    SGLang around the sidecar (1500 tokens, 15 s) keeps it busy past the flush's 10 s."""
    node = make_node("--enable-memory-saver", "--model-path", str(checkpoint),
                     sidecar_flags=("--engine-kind", "sglang"))
    around = start_clients(node.fake.url + "/generate", stream_body(1500), 1)
    wait_until(lambda: node.fake_state()["running"] == 1, timeout=10, what="a request running in SGLang")
    try:
        reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": "v2"})
    finally:
        httpx.post(node.fake.url + "/abort_request", json={"abort_all": True}, timeout=10)
        around[0].finish(30)
    assert reload.status_code == 409 and reload.json()["error"]["type"] == "requests_in_flight", reload.text
    assert "the weights are updated" in reload.json()["error"]["message"]
    calls = node.fake_state()["calls"]
    assert calls.index("update_weights_from_disk") < len(calls) - 1 - calls[::-1].index("flush_cache")
    assert node.fake_state()["weight_version"] == "v2"
    wait_until(lambda: node.occupation()["weight_version"] == "v2" and node.occupation()["serving"], timeout=10,
               what="the node serving the new version")
    node.fake.kill()
    wait_until(lambda: node.occupation()["engine_reachable"] is False, timeout=10, what="engine seen down")
    node.fake.start()  # same port: a new SGLang process, serving its start checkpoint
    wait_until(lambda: node.occupation()["engine_reachable"], timeout=20, what="the fresh SGLang read")
    view = node.occupation()
    assert view["serving"] is False and view["not_serving_reason"] == "weights_stale", view
    r = node.post("/generate", {"input_ids": [5, 6, 7]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weights_stale", r.text
    assert node.post("/update_weights_from_disk", {"model_path": str(checkpoint)}).status_code == 200
    node.wait_serving()
    node.assert_fake_alive()


def test_bad_checkpoints_are_400_while_the_node_keeps_serving(make_node, checkpoint: Path, tmp_path: Path) -> None:
    node = make_node("--enable-memory-saver", "--model-path", str(checkpoint))
    missing = node.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "is not a folder" in missing.json()["error"]["message"]
    other = tmp_path / "wider"
    arch = builtin_arch("builtin:tiny", {"hidden_size": 64, "head_dim": 16})
    save_checkpoint(other, arch, builtin_weights(arch, 0))
    wider = node.post("/update_weights_from_disk", {"model_path": str(other)})
    assert wider.status_code == 400 and "hidden_size" in wider.json()["error"]["message"]
    assert node.occupation()["serving"] is True and "update_weights_from_disk" not in node.fake_state()["calls"]
    dry = node.post("/update_weights_from_disk", {"model_path": str(checkpoint), "dry_run": True})
    assert dry.status_code == 200 and "update_weights_from_disk" not in node.fake_state()["calls"]


def test_files_the_engine_would_refuse_part_way_are_400_before_it_loads(make_node, checkpoint: Path,
                                                                        tmp_path: Path) -> None:
    """A truncated shard (SGLang's safetensors refuses it when it gets there) and a FIFO (whose open never returns)
    are refused by the sidecar's own check, at once, and the engine is never asked to load."""
    node = make_node("--enable-memory-saver", "--model-path", str(checkpoint))
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    r = node.post("/update_weights_from_disk", {"model_path": str(truncated)})
    assert r.status_code == 400 and "bytes after the header" in r.json()["error"]["message"], r.text
    fifo = tmp_path / "fifo"
    shutil.copytree(checkpoint, fifo)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    r = node.post("/update_weights_from_disk", {"model_path": str(fifo)})
    assert r.status_code == 400 and "a FIFO" in r.json()["error"]["message"], r.text
    assert node.occupation()["serving"] is True and "update_weights_from_disk" not in node.fake_state()["calls"]
    node.assert_fake_alive()


def test_a_flush_retracts_a_running_request_and_under_an_in_place_pause_is_retried_to_its_deadline(
        make_node) -> None:
    """A flush with a request running answers at once (SGLang's retract pause around it, the request going on
    after); under SGLang's own ``in_place`` pause the running request keeps its KV, so SGLang is asked again
    until the deadline: 409, and the request still ends whole after the continue."""
    node = make_node("--enable-memory-saver")
    slow = GenerationClient(node.sidecar.url + "/generate", stream_body(1500), timeout=60)  # 15 s at its pace
    slow.start()
    assert slow.started_streaming.wait(10)
    flushed = node.post("/flush_cache", headers={"x-handoff-deadline": "5"})
    assert flushed.status_code == 200 and flushed.json()["success"] is True, flushed.text
    assert node.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    before = node.fake_state()["calls"].count("flush_cache")
    short = node.post("/flush_cache", headers={"x-handoff-deadline": "1"})
    assert short.status_code == 409 and short.json()["error"]["type"] == "requests_in_flight", short.text
    assert node.fake_state()["calls"].count("flush_cache") > before + 1  # asked again
    assert node.post("/continue_generation").status_code == 200
    assert node.post("/abort_request", {"abort_all": True}).status_code == 200
    result = slow.finish(30)
    assert result.saw_done and result.error is None
    node.assert_fake_alive()


def test_a_flush_under_steady_load_retracts_the_running_requests_and_loses_nothing(make_node) -> None:
    """SGLang flushes only when idle, which steady load never gives: the sidecar asked until the deadline and
    answered 409 (three clients sending back to back). Now SGLang's running requests are retracted for the flush
    (its own pause, mode retract, under which it flushes) and continued after: the flush answers at once, nothing
    is refused or lost, and SGLang is left unpaused."""
    node = make_node("--enable-memory-saver")
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 20}}
    load = [SteadyLoad(node.sidecar.url + "/generate", body) for _ in range(3)]
    for client in load:
        client.start()

    def served() -> int:
        return sum(len(client.results) for client in load)

    wait_until(lambda: served() >= 6, timeout=20, what="the load running")
    started = time.monotonic()
    flushed = node.post("/flush_cache", headers={"x-handoff-deadline": "8"})
    took = time.monotonic() - started
    before = served()
    wait_until(lambda: served() >= before + 6, timeout=20, what="the load served after the flush")
    results = [result for client in load for result in client.finish()]
    assert flushed.status_code == 200 and flushed.json()["message"].startswith("Cache flushed."), flushed.text
    assert took < 5
    assert all(r.status == 200 and r.error is None for r in results), [r for r in results if r.status != 200][:3]
    calls = node.fake_state()["calls"]
    retract = calls.index("pause retract")
    assert calls[retract:].index("flush_cache") < calls[retract:].index("continue")
    assert node.occupation()["paused"] is False and node.occupation()["serving"] is True
    node.assert_fake_alive()


def test_memory_saver_off_is_409_naming_sglang_flag(make_node) -> None:
    node = make_node()
    r = node.post("/release_memory_occupation")
    assert r.status_code == 409 and r.json()["error"]["type"] == "memory_saver_disabled"
    assert "--enable-memory-saver" in r.json()["error"]["message"]
    assert node.occupation()["serving"] is True


def test_a_restarted_sglang_is_released_again(make_node, checkpoint: Path) -> None:
    node = make_node("--enable-memory-saver", sidecar_flags=("--engine-kind", "sglang"))
    assert node.post("/release_memory_occupation").status_code == 200
    node.fake.kill()
    wait_until(lambda: node.occupation()["engine_reachable"] is False, timeout=10, what="engine seen down")
    node.fake.start()  # same port: a new SGLang process (another startup_time), everything resident in it
    # the cluster had released the node: the sidecar releases the fresh SGLang again before admitting anything
    wait_until(lambda: node.occupation()["engine_reachable"] and all(
        t["state"] == "released" for t in node.occupation()["tags"].values()), timeout=10, what="released again")
    assert node.occupation()["serving"] is False and node.occupation()["not_serving_reason"] == "node_released"
    assert node.fake_state()["calls"][-1] == "release ['weights', 'kv_cache', 'cuda_graph']"  # the fresh SGLang's
    resumed = node.post("/resume_memory_occupation").json()
    assert resumed["weights_valid"] is False  # no --enable-weights-cpu-backup: garbage until a reload
    assert node.post("/update_weights_from_disk", {"model_path": str(checkpoint)}).status_code == 200
    node.wait_serving()
    assert greedy(node)
    node.assert_fake_alive()


def test_sglang_weight_calls_pass_through_and_updates_resume_released_weights(make_node) -> None:
    node = make_node("--enable-memory-saver")
    group = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    assert node.post("/init_weights_update_group", group).json()["success"] is True
    version = node.post("/update_weight_version", {"new_version": "v9"})
    assert version.status_code == 200 and version.json()["new_version"] == "v9"
    assert node.occupation()["weight_version"] == "v9"
    assert httpx.get(node.sidecar.url + "/get_weight_version", timeout=10).json() == {"weight_version": "v9"}
    assert node.post("/release_memory_occupation").status_code == 200
    outside = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert outside.status_code == 400 and "begin_weight_update" in outside.json()["error"]["message"]
    assert node.occupation()["tags"]["weights"]["state"] == "released"  # refused before anything was woken
    assert node.post("/begin_weight_update", {}).json()["success"] is True
    pushed = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "weight_version": "v10"})
    assert pushed.status_code == 200, pushed.text
    assert pushed.json()["resumed"] == ["weights"] and pushed.json()["weight_version"] == "v10"
    assert node.occupation()["tags"]["weights"]["state"] == "resident"
    assert node.occupation()["weights_valid"] is False  # garbage (no CPU backup) until the session ends
    assert node.post("/end_weight_update", {}).json()["success"] is True
    assert node.occupation()["weights_valid"] is True  # the session's updates are the trainer's whole weights
    assert node.post("/destroy_weights_update_group", {}).json()["success"] is True
    assert node.post("/resume_memory_occupation").json()["serving"] is True
    calls = node.fake_state()["calls"]
    assert calls.index("resume ['weights']") < calls.index("update_weights_from_tensor")
    node.assert_fake_alive()


def test_sglang_pause_modes_retract_releases_and_in_place_is_409(make_node) -> None:
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    kept = start_clients(node.sidecar.url + "/generate", stream_body(150), 2)
    for c in kept:
        assert c.started_streaming.wait(10)
    assert node.post("/pause_generation", {"mode": "in_place"}).json()["mode"] == "in_place"
    # in place, the paused requests hold their KV: SGLang is not idle, so the release is refused, not sent
    refused = node.post("/release_memory_occupation", {"tags": ["kv_cache"]}, headers={"x-handoff-deadline": "30"})
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "requests_in_flight"
    assert "release ['kv_cache']" not in node.fake_state()["calls"]
    assert node.post("/continue_generation").status_code == 200
    assert node.post("/pause_generation", {"mode": "retract"}).status_code == 200
    # retracted requests wait in SGLang's queue, which its idle check ignores while paused: the release runs
    assert node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert node.post("/resume_memory_occupation").status_code == 200
    assert node.post("/continue_generation").status_code == 200
    for c in kept:
        result = c.finish(60)
        assert result.saw_done and result.events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    node.assert_fake_alive()


def test_the_lb_gives_tensor_parallel_sglang_nodes_a_rank_per_tp_rank(make_node, proc_log_dir: Path) -> None:
    """Found by review: no sidecar reported ``tp_size``, so the LB counted every node as one rank. SGLang joins
    each TP rank as ``rank_offset + tp_rank``: two nodes at --tp-size 2 take ranks 1-2 and 3-4 of 5."""
    nodes = [make_node("--tp-size", "2") for _ in range(2)]
    assert all(node.occupation()["tp_size"] == 2 for node in nodes)
    lb = ServerProcess("lb", ["--node", nodes[0].sidecar.url, "--node", nodes[1].sidecar.url,
                              "--health-interval", "0.2"], log_dir=proc_log_dir, name="lb_tp").start()
    try:
        wait_until(lambda: all(n["routable"] and n["tp_size"] == 2
                               for n in httpx.get(lb.url + "/nodes").json()["nodes"]), timeout=20,
                   what="both nodes' states at the LB")
        body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "group_name": "g",
                "backend": "gloo"}
        r = httpx.post(lb.url + "/init_weights_update_group", json={**body, "world_size": 3}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["world_size"] == 5, r.text
        r = httpx.post(lb.url + "/init_weights_update_group", json={**body, "world_size": 5}, timeout=30)
        assert r.status_code == 200, r.text
        offsets = {result["node"]: result["rank_offset"] for result in r.json()["results"]}
        assert offsets == {nodes[0].sidecar.url: 1, nodes[1].sidecar.url: 3}
    finally:
        lb.stop()
        for node in nodes:
            node.assert_fake_alive()


def test_engine_metrics_that_do_not_parse_are_left_out_and_the_nodes_own_still_parse(make_node) -> None:
    """Found by review: whatever the engine's ``/metrics`` answered with a 200 was appended to the node's own
    exposition, so an engine's error page made the whole scrape unreadable, the node's series with it."""
    node = make_node()

    def families() -> set[str]:
        text = httpx.get(node.sidecar.url + "/metrics", timeout=10).text
        return {family.name for family in text_string_to_metric_families(text)}

    assert {"sglang:num_running_reqs", "handoff_node_serving"} <= families()
    for text, content_type in [("<html>500 oops</html>\n", "text/plain"), ('{"error": 1}', "application/json")]:
        httpx.post(node.fake.url + "/_fake/metrics", json={"text": text, "content_type": content_type}, timeout=10)
        names = families()
        assert "handoff_node_serving" in names and "sglang:num_running_reqs" not in names
        assert "engine /metrics left out" in node.occupation()["last_error"]
    # the engine's series vanished from the scrape: the log said nothing of why
    wait_until(lambda: any(" WARNING " in line and "engine /metrics left out: not a Prometheus text" in line
                           for line in node.sidecar.log_path.read_text().splitlines()), timeout=10, what="the warning")
    node.assert_fake_alive()


def test_engine_label_values_with_quotes_backslashes_and_newlines_reach_the_scrape_whole(make_node) -> None:
    """An engine's label values escaped as the text format says (a served model name with a quote, a backslash,
    a newline) are relayed as they are: the node's whole exposition still parses, the values read back intact."""
    node = make_node()
    odd = 'qwen "7b"\\path\n\u00e9'
    escaped = odd.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    text = f'# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name="{escaped}"}} 3.0\n'
    httpx.post(node.fake.url + "/_fake/metrics", json={"text": text}, timeout=10)
    samples = {(sample.name, sample.labels.get("model_name")): sample.value
               for family in text_string_to_metric_families(httpx.get(node.sidecar.url + "/metrics", timeout=10).text)
               for sample in family.samples}
    assert samples[("sglang:num_running_reqs", odd)] == 3.0 and ("handoff_node_serving", None) in samples
    node.assert_fake_alive()


# texts prometheus_client's parser takes and Prometheus' own (textparse) refuses, failing the whole scrape
REFUSED_BY_PROMETHEUS = [
    "sglang:num_running_reqs 1\r\n",                                 # a CRLF line end: the value is "1\r"
    "sglang:num_running_reqs 1 1.5\n",                                # a timestamp is ASCII digits
    "sglang:num_running_reqs 1 -5\n",
    "sglang:num_running_reqs 1 99999999999999999999\n",               # past int64
    "sglang:num_running_reqs 1 2 3\n",                                # a third field
    "sglang:num_running_reqs \u0661\n",                               # a digit of another script
    "sglang:num_running_reqs 1e400\n",                                # past float64
    "sglang:num_running_reqs +nan\n",
    "# TYPE sglang:num_running_reqs info\nsglang:num_running_reqs 1\n",  # not a type of the text format
    "# TYPE sglang:num_running_reqs gauge\r\nsglang:num_running_reqs 1\n",
]


def test_engine_metrics_prometheus_would_refuse_are_left_out(make_node) -> None:
    """Found by review: the engine's text was judged by prometheus_client's parser alone, which takes lines
    Prometheus' own parser refuses (CRLF line ends, a timestamp that is not a whole number of int64, a third
    field, a value in another script's digits or past float64, an OpenMetrics type): appended, they failed the
    node's whole scrape at Prometheus, its own series with it. Such text is now left out, valid text kept."""
    node = make_node()
    for text in REFUSED_BY_PROMETHEUS:
        httpx.post(node.fake.url + "/_fake/metrics", json={"text": text}, timeout=10)
        scraped = httpx.get(node.sidecar.url + "/metrics", timeout=10).text
        assert "sglang:num_running_reqs" not in scraped and "handoff_node_serving" in scraped, repr(text)
    valid = ("# HELP sglang:num_running_reqs Running \\ requests.\n# TYPE sglang:num_running_reqs gauge\n"
             'sglang:num_running_reqs{model_name="a}b"} +Inf 1700000000000\n  sglang:num_running_reqs 5. \n'
             "sglang:num_running_reqs -.5e-3\nsglang:num_running_reqs NaN\n\n")
    httpx.post(node.fake.url + "/_fake/metrics", json={"text": valid}, timeout=10)
    assert httpx.get(node.sidecar.url + "/metrics", timeout=10).text.endswith(valid)
    node.assert_fake_alive()


def test_concurrent_scrapes_share_one_engine_scrape(make_node) -> None:
    """Found by review: ``/metrics`` needs no token, and every scrape made the sidecar scrape the engine (up to
    8 MiB, parsed in a thread): anyone could make the engine and the sidecar's threads work once per request.
    Scrapes asked while one is under way now share it."""
    node = make_node()
    before = node.fake_state()["num_metrics"]
    httpx.post(node.fake.url + "/_fake/next", json={"path": "/metrics", "delay_s": 1.0}, timeout=10)

    async def scrape_together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            return await asyncio.gather(*(client.get(node.sidecar.url + "/metrics") for _ in range(8)))

    answers = asyncio.run(scrape_together())
    assert all(a.status_code == 200 and "sglang:num_running_reqs" in a.text for a in answers)
    assert node.fake_state()["num_metrics"] == before + 1
    node.assert_fake_alive()


def test_a_weight_version_no_client_could_set_is_no_version(make_node, proc_log_dir: Path) -> None:
    """Found by review: an engine reporting a 70 kB ``weight_version`` grew the sidecar's state past what the
    LB's health check reads, which then judged a cut body ("Unterminated string") and took the node out of
    rotation. A version is 1 to 1024 characters, from clients and engines alike."""
    node = make_node("--weight-version", "v" * 70_000)
    assert node.occupation()["weight_version"] is None
    lb = ServerProcess("lb", ["--node", node.sidecar.url, "--health-interval", "0.2"], log_dir=proc_log_dir,
                       name="lb_version").start()
    try:
        wait_until(lambda: httpx.get(lb.url + "/nodes").json()["nodes"][0]["routable"], timeout=20,
                   what="the node routable at the LB")
        r = node.post("/update_weights_from_disk", {"model_path": "/models/x", "weight_version": "v" * 1025})
        assert r.status_code == 400 and "weight_version" in r.text, r.text
        assert node.post("/update_weight_version", {"new_version": "v2"}).status_code == 200
        assert node.occupation()["weight_version"] == "v2"
    finally:
        lb.stop()
        node.assert_fake_alive()


def fault_next(node: Node, path: str, **fault: object) -> None:
    """The stand-in's next answer on ``path``: late (``delay_s``) or replaced (``status``, ``raw``)."""
    httpx.post(node.fake.url + "/_fake/next", json={"path": path, **fault}, timeout=10).raise_for_status()


def test_a_2xx_that_is_not_sglangs_answer_is_never_a_success(make_node, checkpoint: Path) -> None:
    """Every SGLang weight call answers ``{"success": bool, "message"}``: a 200 without ``success: true`` (a proxy's
    text, an empty object) answered success, and after a resume without a backup made garbage weights valid with
    a version SGLang never took (found by review). It is a 502 now, and nothing is adopted."""
    node = make_node("--enable-memory-saver")
    assert node.post("/release_memory_occupation").status_code == 200
    assert node.post("/resume_memory_occupation").json()["weights_valid"] is False
    fault_next(node, "/update_weights_from_disk", status=200, raw="upstream connect error or disconnect")
    answer = node.post("/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": "v12"})
    assert answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_error", answer.text
    view = node.occupation()
    assert view["weights_valid"] is False and view["weight_version"] != "v12" and view["serving"] is False
    assert node.post("/begin_weight_update", {}).json()["success"] is True
    fault_next(node, "/update_weights_from_tensor", status=200, raw="{}", content_type="application/json")
    pushed = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert pushed.status_code == 502, pushed.text
    assert node.post("/end_weight_update", {}).status_code == 200
    assert node.occupation()["weights_valid"] is False  # no update succeeded in that session
    node.assert_fake_alive()


def test_a_continue_while_released_waits_for_every_tag(make_node) -> None:
    """slime's order continues generation before the KV cache is back: SGLang would run the retracted requests
    on unmapped memory (the stand-in dies as SGLang would) or, after a resume without a backup, on garbage
    weights (found by review). The continue is held back until every tag is resident and the weights valid."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    kept = start_clients(node.sidecar.url + "/generate", stream_body(150), 1)
    wait_until(lambda: node.fake_state()["running"] == 1, timeout=10, what="a request running")
    assert node.post("/pause_generation", {"mode": "retract"}).status_code == 200
    assert node.post("/release_memory_occupation").status_code == 200
    assert node.post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert node.post("/continue_generation", {}).status_code == 200
    assert "continue" not in node.fake_state()["calls"]
    assert node.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    assert "continue" in node.fake_state()["calls"]
    for client in kept:
        result = client.finish()
        assert result.status == 200 and result.saw_done, result.error
    node.assert_fake_alive()


def test_a_release_sglang_answers_late_is_remembered_as_done(make_node) -> None:
    """SGLang runs control calls in order: a release it got but answered after the sidecar's timeout still
    happens. The sidecar put the tags back to resident, reported the node serving, and the next generation
    killed SGLang (found by review)."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup", sidecar_flags=("--control-timeout",
                                                                                             "1.5"))
    fault_next(node, "/release_memory_occupation", delay_s=3)
    late = node.post("/release_memory_occupation")
    assert late.status_code == 503, late.text
    view = node.occupation()
    assert view["serving"] is False and view["tags"]["weights"]["state"] == "released", view
    wait_until(lambda: "weights" in node.fake_state()["offload_tags"], timeout=10, what="the late release")
    assert node.post("/generate", {"text": "x"}).status_code == 503
    assert node.post("/resume_memory_occupation").json()["serving"] is True
    node.assert_fake_alive()


def test_a_flush_its_client_left_stops_holding_the_control_lock(make_node) -> None:
    """A flush waits for SGLang holding the control lock; its client giving up left it waiting (up to
    ``--control-timeout``) and every release behind it (found by review: an abort-mode release answered after
    13.6 s, aborting nothing). A client that leaves now ends the wait (here SGLang answers the flush 30 s late),
    and SGLang is continued (the flush paused it, mode retract)."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    running = start_clients(node.sidecar.url + "/generate", stream_body(1500), 1)  # 15 s at the stand-in's pace
    wait_until(lambda: node.occupation()["in_flight"] == 1, timeout=10, what="a request running")
    fault_next(node, "/flush_cache", delay_s=30)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(node.sidecar.url + "/flush_cache", timeout=1.0)
    started = time.monotonic()
    release = node.post("/release_memory_occupation", {"mode": "abort"})
    assert release.status_code == 200 and release.json()["aborted_requests"] == 1, release.text
    assert time.monotonic() - started < 10
    calls = node.fake_state()["calls"]
    released_at = next(i for i, call in enumerate(calls) if call.startswith("release"))
    assert calls.index("pause retract") < calls.index("continue") < released_at, calls  # never left paused
    running[0].finish()
    node.assert_fake_alive()


@pytest.mark.parametrize("info", ["{}", "[]", '{"startup_time": null, "enable_memory_saver": true}'])
def test_server_info_that_names_no_sglang_process_forgets_no_release(make_node, info: str) -> None:
    """SGLang does not say what it released: the adapter forgets its releases when ``startup_time`` names another
    process. A ``/get_server_info`` 2xx without one (a proxy's ``{}``, a list) was taken for a new process: the
    tags released in SGLang were read back as resident, the node served, and the next generation ran on unmapped
    memory (found by review). Such an answer is not SGLang's: the state is not read from it."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    assert node.post("/release_memory_occupation").status_code == 200
    fault_next(node, "/get_server_info", status=200, raw=info, content_type="application/json")
    fault_next(node, "/resume_memory_occupation", status=400, raw='{"error": {"message": "refused"}}',
               content_type="application/json")
    assert node.post("/resume_memory_occupation").status_code == 400  # a failed call: the state is read again
    view = node.occupation()  # not read from that answer: unknown until the next read, never resident
    assert view["serving"] is False and {row["state"] for row in view["tags"].values()} <= {"unknown", "released"}
    wait_until(lambda: {row["state"] for row in node.occupation()["tags"].values()} == {"released"}, timeout=10,
               what="the state read again")
    assert node.occupation()["serving"] is False
    assert node.post("/generate", {"text": "x"}).status_code == 503
    assert node.post("/resume_memory_occupation").json()["serving"] is True
    node.assert_fake_alive()


def test_get_weight_version_reports_only_a_version_a_client_could_set(make_node) -> None:
    """``/get_weight_version`` is read from SGLang's ``/model_info``; what it carried was relayed as it came (a
    70 kB string), where the node's state holds no version for it (found by review). It is the node's rule now:
    1 to 1024 characters, else no version."""
    node = make_node("--weight-version", "v" * 70_000)
    assert httpx.get(node.sidecar.url + "/get_weight_version", timeout=10).json() == {"weight_version": None}
    node.assert_fake_alive()


def test_a_flush_answer_that_is_not_sglangs_is_no_idle_barrier(make_node) -> None:
    """A release waits for SGLang to flush, its only word that it is idle (a release while busy kills it). Any 2xx
    was taken for that word: a proxy's 200 page under an ``in_place`` pause sent the release to a busy SGLang, which
    died; an error page's 500 was the sidecar's own 500 (found by review). Neither is SGLang's answer: 502
    ``upstream_error``, nothing released."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    kept = start_clients(node.sidecar.url + "/generate", stream_body(300), 1)
    assert kept[0].started_streaming.wait(10)
    assert node.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    fault_next(node, "/flush_cache", status=200, raw="<html>OK</html>", content_type="text/html")
    refused = node.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert refused.status_code == 502 and refused.json()["error"]["type"] == "upstream_error", refused.text
    assert not any(call.startswith("release") for call in node.fake_state()["calls"])
    assert node.occupation()["tags"]["kv_cache"]["state"] == "resident"
    fault_next(node, "/flush_cache", status=500, raw="<html>Internal Server Error</html>", content_type="text/html")
    failed = node.post("/flush_cache")
    assert failed.status_code == 502 and failed.json()["error"]["type"] == "upstream_error", failed.text
    assert node.post("/continue_generation").status_code == 200
    assert kept[0].finish(60).saw_done
    node.assert_fake_alive()


@pytest.mark.parametrize("raw", ["{}", '{"status": "error", "message": "not paused"}', "upstream connect error"])
def test_a_pause_or_continue_sglang_did_not_acknowledge_changes_nothing(make_node, raw: str) -> None:
    """SGLang's pause and continue answer 200 ``{"message", "status": "ok"}`` (``http_server.py:1831-1857``). Any
    2xx JSON object was taken for them (found by review): a continue SGLang never acknowledged unpaused the node
    while SGLang still held every request, and a pause was reported done. It is a 502 now, the node as it was."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    fault_next(node, "/pause_generation", status=200, raw=raw, content_type="application/json")
    refused = node.post("/pause_generation", {"mode": "retract"})
    assert refused.status_code == 502 and refused.json()["error"]["type"] == "upstream_error", refused.text
    assert node.occupation()["paused"] is False
    assert node.post("/pause_generation", {"mode": "retract"}).status_code == 200
    fault_next(node, "/continue_generation", status=200, raw=raw, content_type="application/json")
    refused = node.post("/continue_generation", {})
    assert refused.status_code == 502 and refused.json()["error"]["type"] == "upstream_error", refused.text
    assert node.occupation()["paused"] is True
    assert node.post("/continue_generation", {}).status_code == 200
    assert node.occupation()["paused"] is False and greedy(node)
    node.assert_fake_alive()


def test_a_reload_sglang_did_is_not_undone_by_the_version_read_after_it(make_node, checkpoint: Path) -> None:
    """A reload without ``weight_version`` reads the version from SGLang's ``/model_info`` afterwards; that read
    failing (an error page) failed the reload SGLang had done: a 500, and the node left ``weights_valid: false``,
    not serving on weights SGLang had loaded (found by review). The reload stands; the version stays as known."""
    node = make_node("--enable-memory-saver", sidecar_flags=("--engine-poll-interval", "60"))
    assert node.post("/release_memory_occupation").status_code == 200
    assert node.post("/resume_memory_occupation").json()["weights_valid"] is False
    fault_next(node, "/model_info", status=500, raw="<html>Internal Server Error</html>", content_type="text/html")
    loaded = node.post("/update_weights_from_disk", {"model_path": str(checkpoint)})
    assert loaded.status_code == 200, loaded.text
    assert "update_weights_from_disk" in node.fake_state()["calls"]
    view = node.occupation()
    assert view["weights_valid"] is True and view["serving"] is True and view["weight_version"] == "default", view
    assert greedy(node)
    node.assert_fake_alive()


def test_a_redirect_is_no_answer_to_a_control_call(make_node) -> None:
    """A proxy in front of SGLang that redirects (to a login page, say) answered no control call, yet its 302 was
    passed on as the sidecar's own status, without ``Location`` (``raise_for_status`` lets a 3xx through: a
    trainer took the release for done), a 304 lost the error's body, and a weight call's 3xx became a 500 (found
    by review). Each is a 502 ``upstream_error``; nothing is recorded as done."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    for status in (302, 304):
        fault_next(node, "/release_memory_occupation", status=status, raw="")
        refused = node.post("/release_memory_occupation", {"tags": ["kv_cache"]})
        assert refused.status_code == 502 and refused.json()["error"]["type"] == "upstream_error", refused.text
        assert node.occupation()["tags"]["kv_cache"]["state"] == "resident"
    fault_next(node, "/begin_weight_update", status=307, raw="")
    refused = node.post("/begin_weight_update", {})
    assert refused.status_code == 502 and refused.json()["error"]["type"] == "upstream_error", refused.text
    assert node.fake_state()["offload_tags"] == [] and node.occupation()["serving"] is True
    assert node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert node.post("/resume_memory_occupation").status_code == 200
    node.assert_fake_alive()


JSON = "application/json"


@pytest.mark.parametrize("status,raw,content_type", [
    (200, '{"success": false, "message": "boom"}', JSON),   # success false with a 2xx: no SGLang 0.5.23 answer
    (500, "Internal Server Error", "text/plain"),            # uvicorn's page for an exception SGLang did not catch
    (400, "<html>400 Bad Request</html>", "text/html"),      # a proxy's 400: SGLang's 400s are JSON objects
    (503, '{"detail": "upstream overloaded"}', JSON),
])
def test_a_weight_call_sglang_failed_is_502_naming_it(make_node, checkpoint: Path, status: int, raw: str,
                                                      content_type: str) -> None:
    """Found by review: a 2xx ``success: false`` and any 5xx from SGLang were the sidecar's own 500
    (``engine_failed``, "a model step raised"), and a 400 that was not SGLang's (a proxy's page) a 400
    ``invalid_request`` blaming the client. SGLang fails every weight call with 400 and its JSON
    (``http_server.py:1300-1557``); anything else is the peer's failure: 502 ``upstream_error`` naming SGLang."""
    node = make_node("--enable-memory-saver")
    for path, body in [("/begin_weight_update", {}), ("/update_weights_from_disk", {"model_path": str(checkpoint),
                                                                                   "weight_version": "v2"})]:
        fault_next(node, path, status=status, raw=raw, content_type=content_type)
        r = node.post(path, body)
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
        assert "SGLang" in r.json()["error"]["message"] and path in r.json()["error"]["message"], r.text
    view = node.occupation()
    assert view["weight_version"] == "default" and view["weights_valid"] and view["serving"], view
    # the session SGLang never opened stays closed: a push is refused before it is sent
    pushed = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert pushed.status_code == 400 and "begin_weight_update" in pushed.json()["error"]["message"], pushed.text
    assert "update_weights_from_tensor" not in node.fake_state()["calls"]
    node.assert_fake_alive()


def test_sglangs_own_refusal_is_its_400_with_its_message(make_node) -> None:
    node = make_node("--enable-memory-saver")
    r = node.post("/destroy_weights_update_group", {})  # weight_updater.py:153: no such group
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"], r.text
    assert node.post("/end_weight_update", {}).status_code == 400  # no session open (weight_updater.py:322-327)
    node.assert_fake_alive()


@pytest.mark.parametrize("status,raw", [(500, "Internal Server Error"), (400, "Bad Request"), (401, "")])
def test_a_release_sglang_failed_is_502_and_nothing_is_taken_as_done(make_node, status: int, raw: str) -> None:
    """Found by review: a release or resume SGLang answered with an error page was the sidecar's own 500 (or the
    status as it came, a 401 for the sidecar's own key blamed on the client). 502 naming SGLang now."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    fault_next(node, "/release_memory_occupation", status=status, raw=raw)
    r = node.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
    assert r.json()["error"]["engine_status"] == status and "SGLang" in r.json()["error"]["message"]
    assert node.occupation()["tags"]["kv_cache"]["state"] == "resident" and node.occupation()["serving"]
    assert node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    fault_next(node, "/resume_memory_occupation", status=status, raw=raw)
    r = node.post("/resume_memory_occupation", {})
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
    assert node.occupation()["tags"]["kv_cache"]["state"] == "released"
    assert node.post("/resume_memory_occupation", {}).json()["serving"] is True
    node.assert_fake_alive()


def test_a_release_answered_2xx_but_not_null_is_502_and_nothing_is_taken_as_done(make_node) -> None:
    """SGLang's release answers ``null``; a 2xx page (a proxy's, which never passed the call on) was a 503
    ``engine_unavailable`` and the tags remembered as released, so the next resume asked SGLang for a tag it
    never released, and SGLang died of the ``KeyError`` (found by review). Not SGLang's answer: 502, nothing done,
    as for a redirect."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    fault_next(node, "/release_memory_occupation", status=200, raw="<html>ok</html>", content_type="text/html")
    r = node.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
    assert node.occupation()["tags"]["kv_cache"]["state"] == "resident" and node.occupation()["serving"]
    assert node.post("/resume_memory_occupation", {}).json()["resumed"] == []
    assert node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert node.post("/resume_memory_occupation", {}).json()["serving"] is True
    node.assert_fake_alive()


def test_a_session_call_sglang_answers_late_still_opens_and_closes_it(make_node) -> None:
    """SGLang runs control calls in order: a ``begin_weight_update`` it answered after the sidecar's timeout still
    opens its session. The sidecar took it as not opened and refused every push with "must run between
    begin_weight_update and end_weight_update", while a begin again got SGLang's "already open" (found by
    review): the trainer could not push. A late begin or end now counts as done, as a late release does."""
    node = make_node("--enable-memory-saver", sidecar_flags=("--control-timeout", "1.5"))
    fault_next(node, "/begin_weight_update", delay_s=3)
    assert node.post("/begin_weight_update", {}).status_code == 503
    wait_until(lambda: node.fake_state()["is_session_open"], timeout=10, what="SGLang's session open")
    pushed = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "weight_version": "v3"})
    assert pushed.status_code == 200, pushed.text
    fault_next(node, "/end_weight_update", delay_s=3)
    assert node.post("/end_weight_update", {}).status_code == 503
    wait_until(lambda: not node.fake_state()["is_session_open"], timeout=10, what="SGLang's session closed")
    refused = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert refused.status_code == 400 and "begin_weight_update" in refused.json()["error"]["message"], refused.text
    assert node.fake_state()["calls"].count("update_weights_from_tensor") == 1
    node.assert_fake_alive()


def test_an_update_sglang_loaded_but_could_not_flush_is_its_400_and_the_version_stays(make_node) -> None:
    """Under an ``in_place`` pause the paused requests keep running in SGLang's batch: an update loads the weights,
    then its cache flush is refused and SGLang answers 400 ``success: false`` "Weights were updated, but ...",
    keeping the version its ``/model_info`` reports (``weight_updater.py:117-130``,
    ``tokenizer_control_mixin.py:592-594``). The sidecar reports that 400 with SGLang's words and keeps the
    version SGLang reports."""
    node = make_node("--enable-memory-saver", "--enable-weights-cpu-backup")
    kept = start_clients(node.sidecar.url + "/generate", stream_body(300), 1)
    assert kept[0].started_streaming.wait(10)
    assert node.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    assert node.post("/begin_weight_update", {}).status_code == 200
    pushed = node.post("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "weight_version": "v4"})
    assert pushed.status_code == 400 and "Weights were updated" in pushed.json()["error"]["message"], pushed.text
    assert node.occupation()["weight_version"] == "default" == node.fake_state()["weight_version"]
    assert node.post("/end_weight_update", {}).status_code == 200
    assert node.post("/continue_generation", {}).status_code == 200
    assert kept[0].finish(60).saw_done
    assert node.post("/update_weight_version", {"new_version": "v4"}).json()["new_version"] == "v4"
    assert node.occupation()["weight_version"] == "v4" and node.occupation()["serving"]
    node.assert_fake_alive()


def test_a_reload_sglang_failed_part_way_takes_the_node_out_until_a_reload_succeeds(
        make_node, checkpoint: Path, tmp_path: Path) -> None:
    """SGLang does not roll back a disk reload that fails part way (its "rollback" reads the new checkpoint
    again, ``model_runner_components/weight_updater.py:193``, ``229-237``): it answers 400 with the new weights
    loaded and the old version reported. The sidecar passed the 400 on and went on serving them under the old
    version (found by review). Now the node serves nothing, ``weights_valid: false``, until a reload succeeds;
    a reload SGLang refused before reading anything leaves it serving."""
    node = make_node("--enable-memory-saver", "--model-path", str(checkpoint))
    before = greedy(node)
    step = tmp_path / "step-3"
    arch = builtin_arch("builtin:tiny")
    save_checkpoint(step, arch, builtin_weights(arch, 1))
    nothing_read = '{"success": false, "message": "Failed to get weights iterator: no such file.", ' \
                   '"num_paused_requests": 0}'
    fault_next(node, "/update_weights_from_disk", status=400, raw=nothing_read, content_type="application/json")
    refused = node.post("/update_weights_from_disk", {"model_path": str(step), "weight_version": "step-3"})
    assert refused.status_code == 400 and "weights_valid" not in refused.json()["error"], refused.text
    assert node.occupation()["serving"] is True and greedy(node) == before
    fault_next(node, "/update_weights_from_disk", load_fails="safetensors_rust.SafetensorError: I/O error")
    failed = node.post("/update_weights_from_disk", {"model_path": str(step), "weight_version": "step-3"})
    error = failed.json()["error"]
    assert failed.status_code == 400 and "Rolling back to original weights" in error["message"], failed.text
    assert error["weights_valid"] is False and "until a reload succeeds" in error["message"]
    assert node.fake_state()["weights_from"] == str(step)  # what SGLang serves now, under the old version
    view = node.occupation()
    assert view["weights_valid"] is False and view["serving"] is False and view["weight_version"] == "default"
    r = node.post("/generate", {"input_ids": [5, 6, 7]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weights_not_loaded", r.text
    wait_until(lambda: node.fake_state()["running"] == 0, timeout=10, what="the last batch let go")  # else the
    # flush after the load is refused
    reload = node.post("/update_weights_from_disk", {"model_path": str(checkpoint)})
    assert reload.status_code == 200, reload.text
    assert node.occupation()["serving"] is True and greedy(node) == before
    node.assert_fake_alive()


@pytest.mark.timeout(30)
async def test_a_flush_whose_deadline_is_spent_is_a_504_and_sends_nothing() -> None:
    """Found by review: each ``/flush_cache`` to SGLang got at least 1 s whatever was left of the caller's deadline,
    so a flush whose deadline was spent (waiting behind another control call) was sent all the same. Now a flush is
    bounded by what is left (none: a 504 at once, nothing sent); a release's idle barrier keeps its floor. The
    flush's first call is SGLang's retract pause; the continue that follows it whatever happened gets at least 1 s
    (SGLang must not stay paused)."""
    from node_sidecar.engines.sglang import SglangEngine
    from tests.node_sidecar.silent_engine import flush_deadlines

    took, late, connections = await flush_deadlines(SglangEngine, spent=(0, -1.5), late_s=0.3)
    assert late.extra["timeout_s"] <= 0.3 and took < 5, (late.extra, took)  # the floor gave the call 1 s
    assert "/pause_generation" in late.message and connections == 2  # the pause, then the continue


def test_a_flush_whose_continue_sglang_refuses_leaves_the_node_honestly_paused(make_node) -> None:
    """A flush pauses SGLang (mode retract) and continues it after; a continue SGLang refused (here a 500, the
    continue not run) left SGLang holding every generation while the node said it was serving, its clients waiting
    unanswered. The node is read from SGLang again after a failed flush: paused, and a continue lifts it."""
    node = make_node("--enable-memory-saver")
    fault_next(node, "/continue_generation", status=500, raw="Internal Server Error")
    flushed = node.post("/flush_cache", headers={"x-handoff-deadline": "5"})
    assert flushed.status_code == 502, flushed.text
    occupation = node.occupation()
    assert occupation["paused"] is True and occupation["serving"] is False, occupation
    continued = node.post("/continue_generation")
    assert continued.status_code == 200 and continued.json()["serving"] is True, continued.text
    assert greedy(node)


def test_a_flush_under_the_sidecars_own_pause_leaves_the_node_paused(make_node) -> None:
    """The sidecar's own pause (mode wait) leaves SGLang unpaused: a flush then retracts and continues SGLang, and
    the node stays paused from the client's view until its own continue."""
    node = make_node("--enable-memory-saver")
    assert node.post("/pause_generation", {"mode": "wait"}).status_code == 200
    flushed = node.post("/flush_cache", headers={"x-handoff-deadline": "5"})
    assert flushed.status_code == 200, flushed.text
    occupation = node.occupation()
    assert occupation["paused"] is True and occupation["serving"] is False, occupation
    assert node.post("/continue_generation").json()["serving"] is True
    assert greedy(node)


def test_a_flush_with_a_batch_of_samples_running_ends_each_whole_and_an_abort_under_it_ends_its_request(
        make_node) -> None:
    """A batch of two prompts with ``n`` 2 running through a flush (SGLang's retract held 1 s: its flush answered
    late) ends with every sample whole, the same tokens as without the flush; a request aborted while retracted
    ends at once as aborted, and SGLang is continued after."""
    node = make_node("--enable-memory-saver")
    batch = {"input_ids": [[1, 2, 3], [4, 5, 6]], "sampling_params": {"max_new_tokens": 60, "n": 2}}
    reference = node.post("/generate", batch)
    assert reference.status_code == 200, reference.text
    url = node.sidecar.url + "/generate"
    running = GenerationClient(url, batch)
    victim = GenerationClient(url, {**stream_body(1500), "rid": "victim"})
    running.start()
    victim.start()
    wait_until(lambda: node.occupation()["in_flight"] == 2, timeout=10, what="two requests running")
    fault_next(node, "/flush_cache", delay_s=1.5)
    flush = GenerationClient(node.sidecar.url + "/flush_cache", {}, headers={"x-handoff-deadline": "8"})
    flush.start()
    wait_until(lambda: "pause retract" in node.fake_state()["calls"], timeout=10, what="the retract pause")
    assert node.post("/abort_request", {"rid": "victim"}).status_code == 200
    victim.join(10)
    assert victim.result.finish_reason == "abort", victim.result.summary(0)
    flush.join(10)
    running.join(30)
    assert flush.result.status == 200, flush.result.summary(0)
    assert running.result.status == 200, running.result.summary(0)

    def samples(answer: list[dict]) -> list[tuple]:
        return [(a["index"], a["output_ids"], a["meta_info"]["finish_reason"]) for a in answer]
    assert samples(running.result.body) == samples(reference.json()) and len(reference.json()) == 4
    assert node.fake_state()["calls"][-1] != "pause retract" and node.occupation()["serving"] is True


def test_a_flush_whose_continue_is_answered_late_and_one_inside_an_update_session(make_node) -> None:
    """A continue SGLang runs but answers past the flush's deadline: the caller gets an error (not known to have
    run), and the node, read from SGLang again, serves. A flush inside a weight update session, then a release and
    an update right after it, each run in turn."""
    node = make_node("--enable-memory-saver")
    fault_next(node, "/continue_generation", delay_s=30)
    late = node.post("/flush_cache", headers={"x-handoff-deadline": "2"})
    assert late.status_code in (503, 504), late.text
    assert node.occupation()["serving"] is True
    assert node.post("/begin_weight_update", {}).status_code == 200
    flushed = node.post("/flush_cache", headers={"x-handoff-deadline": "5"})
    assert flushed.status_code == 200, flushed.text
    assert node.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert node.post("/flush_cache", headers={"x-handoff-deadline": "5"}).status_code == 200  # a tag out: no retract
    assert node.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert node.post("/end_weight_update", {}).status_code == 200
    assert node.occupation()["serving"] is True and greedy(node)

"""SGLang's control semantics through a sidecar in front of a real engine: pause modes and what new requests get,
tag names as SGLang clients know them, reloads while released, versions, aborts, weight pushes while paused."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from handoff.weight_sync import serialize_named_tensors
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.support.procs import ServerProcess, wait_until
from tests.support.sse import DONE, iter_events

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def node(proc_log_dir: Path):
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver"],
                           log_dir=proc_log_dir, name="engine")
    engine.start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                             "--hold-timeout", "30"], log_dir=proc_log_dir, name="sidecar")
    sidecar.start()
    yield sidecar
    sidecar.stop()
    engine.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(folder, builtin_arch("builtin:tiny", {}), builtin_weights(builtin_arch("builtin:tiny", {}), 0))
    return folder


@pytest.fixture
def client(node, checkpoint):
    with httpx.Client(base_url=node.url, timeout=60) as c:
        wait_until(lambda: c.get("/ready").status_code == 200, timeout=10, what="serving")
        yield c
        c.post("/continue_generation", json={})
        c.post("/resume_memory_occupation", json={})
        if not c.get("/memory_occupation").json()["weights_valid"]:
            c.post("/update_weights_from_disk", json={"model_path": str(checkpoint)})
        c.post("/update_weight_version", json={"new_version": "default"})
        wait_until(lambda: c.get("/ready").status_code == 200, timeout=10, what="serving again")


def greedy(client: httpx.Client, n: int = 10) -> list[int]:
    r = client.post("/generate", json={"text": "probe", "sampling_params": dict(GREEDY, max_new_tokens=n)})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def stream_in_thread(client_url: str, n: int) -> tuple[threading.Thread, dict]:
    """A stream read in a thread; returns once its first event came (the request is prefilled and holds KV:
    a request still queued holds none, and a release around it succeeds, as a slow CI run showed)."""
    result: dict = {}
    first_event = threading.Event()

    def run() -> None:
        events: list[dict] = []
        done = False
        with httpx.Client(base_url=client_url, timeout=120) as c, c.stream("POST", "/generate", json={
                "text": "probe", "stream": True, "sampling_params": dict(GREEDY, max_new_tokens=n)}) as response:
            for data in iter_events(response):
                if data == DONE:
                    done = True
                    continue
                events.append(json.loads(data))
                first_event.set()
        result.update(events=events, done=done)

    thread = threading.Thread(target=run)
    thread.start()
    assert first_event.wait(60), "the stream sent no event"
    return thread, result


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keeps_running_requests_and_holds_new_ones_until_continue(client, node, mode: str) -> None:
    expected = greedy(client, 300)
    thread, result = stream_in_thread(node.url, 300)
    wait_until(lambda: client.get("/memory_occupation").json()["in_flight"] == 1, timeout=10, what="streaming")
    r = client.post("/pause_generation", json={"mode": mode})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert r.json()["paused_requests"] == 1 and r.json()["retracted_requests"] == (mode == "retract")
    view = client.get("/memory_occupation").json()
    assert view["paused"] and view["admission"] == "holding" and view["in_flight"] == 1
    # a new request while paused waits (SGLang queues it) and completes after the continue
    held: dict = {}
    waiter = threading.Thread(target=lambda: held.update(r=httpx.post(
        node.url + "/generate", json={"text": "probe", "sampling_params": dict(GREEDY, max_new_tokens=10)},
        timeout=60)))
    waiter.start()
    wait_until(lambda: client.get("/memory_occupation").json()["held"] == 1, timeout=10, what="held")
    assert thread.is_alive()
    # a release under the pause: around retracted requests (no KV held), refused while paused ones hold KV
    r = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    if mode == "retract":
        assert r.status_code == 200 and r.json()["drained_requests"] == 0, r.text
        assert client.post("/resume_memory_occupation", json={}).status_code == 200
    else:
        assert r.status_code == 409 and r.json()["error"]["type"] == "requests_in_flight", r.text
    r = client.post("/continue_generation", json={"torch_empty_cache": True})
    assert r.status_code == 200 and r.json()["paused"] is False
    thread.join(60)
    waiter.join(60)
    assert result["done"] and result["events"][-1]["output_ids"] == expected  # each event: the answer so far
    assert held["r"].status_code == 200 and held["r"].json()["output_ids"] == expected[:10]


def test_a_push_while_paused_in_place_loads_without_draining(client, node) -> None:
    thread, result = stream_in_thread(node.url, 300)
    wait_until(lambda: client.get("/memory_occupation").json()["in_flight"] == 1, timeout=10, what="streaming")
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    weights = builtin_weights(builtin_arch("builtin:tiny", {}), seed=4)
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(weights.items())], "weight_version": "v-paused"})
    assert r.status_code == 200 and r.json()["drained_requests"] == 0, r.text
    assert client.post("/continue_generation").status_code == 200
    thread.join(60)
    assert result["done"] and result["events"][-1]["meta_info"]["weight_version"] == "v-paused"
    assert client.get("/get_weight_version").json() == {"weight_version": "v-paused"}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_answer_spanning_a_version_change_under_a_pause_reports_its_spans(client, node, mode: str) -> None:
    """SGLang 0.5.23 (``utils/weight_versions.py``): a final answer's ``meta_info.weight_versions`` says which
    output tokens each version made; ``weight_version`` is the last span's. A request paused across an update
    keeps the old version for the tokens it had; a retracted one aborted before it ran again has only those
    (``_make_abort_req`` in its scheduler)."""
    old = client.get("/get_weight_version").json()["weight_version"]
    thread, result = stream_in_thread(node.url, 300)
    assert client.post("/pause_generation", json={"mode": mode}).status_code == 200
    r = client.post("/update_weight_version", json={"new_version": "v-spans", "abort_all_requests": False})
    assert r.status_code == 200, r.text
    assert client.post("/continue_generation", json={}).status_code == 200
    thread.join(60)
    assert result["done"]
    meta = result["events"][-1]["meta_info"]
    spans = meta.get("weight_versions")
    assert spans is not None and len(spans) == 2, meta
    made_before = spans[0]["end"]
    assert 0 < made_before < 300 and len(result["events"][0]["output_ids"]) <= made_before
    assert spans == [{"version": old, "start": 0, "end": made_before},
                     {"version": "v-spans", "start": made_before, "end": 300}]
    assert meta["weight_version"] == "v-spans" and "weight_versions" not in result["events"][0]["meta_info"]
    r = client.post("/generate", json={"text": "probe", "sampling_params": dict(GREEDY, max_new_tokens=5)})
    assert r.json()["meta_info"]["weight_versions"] == [{"version": "v-spans", "start": 0, "end": 5}]
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": model, "prompt": "probe", "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    assert r.json()["metadata"] == {"weight_version": "v-spans",
                                    "weight_versions": [{"version": "v-spans", "start": 0, "end": 3}]}, r.text
    if mode == "in_place":
        return  # SGLang answers an abort of an in_place paused request only after the continue
    # retracted under "v-spans", renamed, aborted while waiting: it made all its tokens under "v-spans"
    thread, result = stream_in_thread(node.url, 300)
    assert client.post("/pause_generation", json={"mode": mode}).status_code == 200
    r = client.post("/update_weight_version", json={"new_version": "v-after", "abort_all_requests": False})
    assert r.status_code == 200, r.text
    assert client.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
    thread.join(60)
    meta = result["events"][-1]["meta_info"]
    made = len(result["events"][-1]["output_ids"])
    assert meta["finish_reason"]["type"] == "abort" and 0 < made < 300, meta
    assert meta["weight_version"] == "v-spans"
    assert meta["weight_versions"] == [{"version": "v-spans", "start": 0, "end": made}]


def test_slimes_resume_order_ends_serving(client) -> None:
    """slime: release everything; resume ["weights"], then ["kv_cache", "cuda_graph"] (no workspace named)."""
    assert client.post("/release_memory_occupation", json={}).status_code == 200
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    r = client.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph", "weights_drafter"]})
    assert r.status_code == 200, r.text
    assert r.json()["resumed"] == ["kv_cache", "cuda_graph", "workspace"] and r.json()["not_present"] == [
        "weights_drafter"]


def test_a_reload_while_everything_is_released_resumes_only_the_weights(client, checkpoint) -> None:
    expected = greedy(client)
    assert client.post("/release_memory_occupation", json={}).status_code == 200
    r = client.post("/update_weights_from_disk", json={"model_path": str(checkpoint), "weight_version": "disk",
                                                       "abort_all_requests": True, "flush_cache": True})
    assert r.status_code == 200 and 0 < r.json()["read_s"] <= r.json()["duration_s"], r.text
    tags = client.get("/memory_occupation").json()["tags"]
    assert tags["weights"]["state"] == "resident" and tags["kv_cache"]["state"] == "released"
    assert client.post("/resume_memory_occupation", json={}).json()["serving"] is True
    assert greedy(client) == expected


def test_keep_pause_changes_nothing_as_in_sglang(client, checkpoint) -> None:
    """SGLang 0.5.23 declares ``keep_pause`` and reads it nowhere: a node that was serving serves on (it was
    left paused, refusing generation until someone called continue_generation)."""
    r = client.post("/update_weights_from_disk", json={"model_path": str(checkpoint), "keep_pause": True})
    assert r.status_code == 200 and r.json()["serving"] is True, r.text
    assert client.get("/memory_occupation").json()["paused"] is False


def test_a_reload_with_sglangs_whole_body(client, checkpoint) -> None:
    """Every field of SGLang 0.5.23's UpdateWeightFromDiskReqInput at once (as AReaL and slime send them):
    accepted, the version and token step recorded, the node serving afterwards."""
    expected = greedy(client)
    body = {"model_path": str(checkpoint), "load_format": None, "abort_all_requests": False,
            "weight_version": "step-7", "is_async": False, "torch_empty_cache": True, "keep_pause": False,
            "recapture_cuda_graph": True, "token_step": 7, "flush_cache": True, "manifest": None}
    r = client.post("/update_weights_from_disk", json=body)
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["serving"] is True, r.text
    info = client.get("/model_info").json()
    assert (info["weight_version"], info["token_step"]) == ("step-7", 7)
    assert greedy(client) == expected
    for refused in (-1, 2**63, 10**4000):  # SGLang's token_step is an int64
        r = client.post("/update_weights_from_disk", content=json.dumps({**body, "token_step": refused}),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", (refused, r.text[:300])
    assert client.get("/model_info").json()["token_step"] == 7  # the refused calls changed nothing


def test_a_5000_character_path_is_400_through_the_sidecar(client) -> None:
    r = client.post("/update_weights_from_disk", json={"model_path": "/" + "x" * 5000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"


def test_versions_model_info_pinning_and_aborts(client) -> None:
    r = client.post("/update_weight_version", json={"new_version": "step-9"})
    assert r.json() == {"success": True, "message": "Weight version updated to step-9", "new_version": "step-9"}
    assert client.get("/get_weight_version").json() == {"weight_version": "step-9"}
    info = client.get("/get_model_info").json()
    assert info["weight_version"] == "step-9" and info["is_generation"] is True
    assert client.get("/model_info").json() == info
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    assert client.post("/generate", json=body, headers={"X-Weight-Version": "step-9"}).status_code == 200
    r = client.post("/generate", json=body, headers={"X-Weight-Version": "step-8"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weight_version_unavailable"
    assert r.headers["retry-after"]
    # verl's abort body, and an unknown rid: both 200 (SGLang's answers)
    assert client.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200


@pytest.mark.parametrize("call", [("/abort_request", {"rid": "", "abort_all": True}),
                                  ("/update_weight_version", {"new_version": "v-aborting"}),
                                  ("/update_weight_version", {"new_version": "v-kept", "abort_all_requests": False})])
def test_what_ends_running_requests_and_what_does_not(client, node, call: tuple[str, dict]) -> None:
    """verl's abort_all ends a running request; update_weight_version does too unless told not to (SGLang's
    ``abort_all_requests`` defaults to true), and then the request finishes whole."""
    path, body = call
    thread, result = stream_in_thread(node.url, 300)
    wait_until(lambda: client.get("/memory_occupation").json()["in_flight"] == 1, timeout=10, what="streaming")
    assert client.post(path, json=body).status_code == 200
    thread.join(60)
    last = result["events"][-1]
    if body.get("abort_all_requests", True):
        assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < 300, last
    else:
        assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 300
    if path == "/update_weight_version":
        assert client.get("/get_weight_version").json() == {"weight_version": body["new_version"]}

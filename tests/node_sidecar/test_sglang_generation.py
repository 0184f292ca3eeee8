"""Generation through the sidecar in front of SGLang: what SGLang 0.5.23 answers reaches the client as it was,
each request counts once in flight whatever it holds, and a client that leaves ends its request in SGLang.

Against the stand-in (``tests/support/sglang_fake.py``), which answers batches, ``n``, SGLang's error shapes and
aborts on a client's disconnect as SGLang does (its docstring names the source lines).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.node_sidecar.test_sglang_adapter import Node
from tests.support.procs import wait_until
from tests.support.sse import iter_events


@pytest.fixture(scope="module")
def node(proc_log_dir: Path):
    node = Node(proc_log_dir)
    yield node
    node.stop()


def in_flight(node: Node) -> int:
    return node.occupation()["in_flight"]


def aborted_on_disconnect(node: Node) -> list[str]:
    return [call for call in node.fake_state()["calls"] if call.endswith("(client disconnected)")]


def stream_events(response: httpx.Response) -> list[str]:
    return list(iter_events(response))


@pytest.mark.parametrize("body, message", [
    ({"sampling_params": {"max_new_tokens": 2}}, "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": []}, "input_ids cannot be empty."),
    ({"text": ["a", "b"], "rid": ["x"]}, "The specified rids length mismatch"),
])
def test_sglangs_400_reaches_the_client_with_its_body_and_counts_nothing(node: Node, body: dict,
                                                                         message: str) -> None:
    r = node.post("/generate", body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
    assert r.headers["content-type"] == "application/json" and int(r.headers["content-length"]) == len(r.content)
    # a stream is already 200 when SGLang fails it: its error event and [DONE] pass on as SGLang wrote them
    with httpx.stream("POST", node.sidecar.url + "/generate", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = stream_events(r)
    assert events[-1] == "[DONE]" and len(events) == 2, events
    error = json.loads(events[0])["error"]
    assert error["message"].startswith(message) and error["type"] == "invalid_request_error"
    # FastAPI's own 400 shape, for a body that is no object
    r = httpx.post(node.sidecar.url + "/generate", content=b"[1, 2]", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400, r.text
    assert in_flight(node) == 0
    node.assert_fake_alive()


def test_a_batch_with_n_is_one_request_in_flight_and_answers_sglangs_list(node: Node) -> None:
    body = {"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 3, "n": 2}}
    r = node.post("/generate", body)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert [a["index"] for a in answers] == [0, 1, 2, 3] and all(len(a["output_ids"]) == 3 for a in answers)
    assert answers[0]["output_ids"] == answers[1]["output_ids"] != answers[2]["output_ids"]
    with httpx.stream("POST", node.sidecar.url + "/generate", json={**body, "stream": True,
                      "sampling_params": {"max_new_tokens": 300, "n": 2}}, timeout=30) as r:
        events = iter_events(r)
        first = json.loads(next(events))
        assert "index" in first
        assert in_flight(node) == 1  # one HTTP request, whatever it holds: what a drain waits for
    wait_until(lambda: in_flight(node) == 0, timeout=10, what="the batch's lease given back")


def test_a_client_that_leaves_ends_its_request_in_sglang(node: Node) -> None:
    before = len(aborted_on_disconnect(node))
    body = {"input_ids": [1, 2, 3], "rid": "leaving-stream", "stream": True,
            "sampling_params": {"max_new_tokens": 2000}}
    with httpx.stream("POST", node.sidecar.url + "/generate", json=body, timeout=30) as r:
        next(iter_events(r))
    wait_until(lambda: len(aborted_on_disconnect(node)) == before + 1, timeout=10, what="the stream aborted")
    assert aborted_on_disconnect(node)[-1] == "abort leaving-stream (client disconnected)"
    # non-stream: SGLang sees the sidecar's connection close and aborts (a batch: every request of it)
    body = {"input_ids": [[1, 2], [3, 4]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2000}}
    left = threading.Event()

    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(node.sidecar.url + "/generate", json=body, timeout=1.0)
        left.set()

    thread = threading.Thread(target=leave, daemon=True)
    thread.start()
    assert left.wait(10)
    wait_until(lambda: len(aborted_on_disconnect(node)) == before + 3, timeout=10, what="the batch aborted")
    assert sorted(aborted_on_disconnect(node)[-2:]) == [f"abort {rid} (client disconnected)" for rid in "ab"]
    wait_until(lambda: in_flight(node) == 0 and node.fake_state()["running"] == 0, timeout=10,
               what="nothing left running")
    # the rids are free again: SGLang would refuse a rid still running (400 "Duplicate request ID")
    r = node.post("/generate", {**body, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and [a["meta_info"]["id"] for a in r.json()] == ["a", "b"], r.text


def test_a_rid_sglang_still_runs_is_its_400(node: Node) -> None:
    body = {"input_ids": [1], "rid": "twice", "stream": True, "sampling_params": {"max_new_tokens": 300}}
    with httpx.stream("POST", node.sidecar.url + "/generate", json=body, timeout=30) as r:
        events = iter_events(r)  # held: a generator dropped closes the connection, and SGLang frees the rid
        next(events)
        again = node.post("/generate", {**body, "stream": False})
        assert again.status_code == 400, again.text
        assert again.json() == {"error": {"message": "Duplicate request ID detected: twice"}}
    node.assert_fake_alive()


def test_a_finished_rid_is_free_at_once(node: Node) -> None:
    """SGLang drops a request's rid when its answer is complete (``tokenizer_manager.py:2774``); the stand-in kept
    it taken while the finished batch lingered, and refused a rid used again at once as a duplicate."""
    body = {"input_ids": [1], "rid": "reused", "sampling_params": {"max_new_tokens": 1}}
    for _ in range(2):
        r = node.post("/generate", body)
        assert r.status_code == 200 and r.json()["meta_info"]["id"] == "reused", r.text
    node.assert_fake_alive()


def test_completions_and_a_pinned_version_through_an_sglang_node(node: Node) -> None:
    r = node.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = node.post("/v1/completions", {"model": "m"})
    assert r.status_code == 400 and r.json()["object"] == "error", r.text  # SGLang's OpenAI error, as it was
    calls = len(node.fake_state()["calls"])
    r = node.post("/generate", {"input_ids": [1]}, headers={"x-weight-version": "not-served"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "weight_version_unavailable", r.text
    assert len(node.fake_state()["calls"]) == calls  # never reached SGLang
    r = node.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
                  headers={"x-weight-version": "default"})
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "default", r.text
    assert in_flight(node) == 0


def test_a_late_health_generate_is_a_504_and_leaves_the_node_serving(proc_log_dir: Path) -> None:
    """The one-token probe waits behind a busy engine's queue: its timeout marked the engine unreachable, so the
    node stopped admitting and the LB routed around a healthy node (found by review). It is a generation now: a
    504, the engine not taken for down."""
    node = Node(proc_log_dir, sidecar_flags=("--generate-timeout", "1"))
    try:
        httpx.post(node.fake.url + "/_fake/next", json={"path": "/generate", "delay_s": 3.0},
                   timeout=10).raise_for_status()
        probe = httpx.get(node.sidecar.url + "/health_generate", timeout=30)
        assert probe.status_code == 504 and probe.json()["error"]["type"] == "upstream_timeout", probe.text
        view = node.occupation()
        assert view["engine_reachable"] is True and view["serving"] is True, view
        answer = node.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200, answer.text
    finally:
        node.stop()


def test_a_pin_to_a_non_ascii_version_is_read_as_utf8(node: Node) -> None:
    """A version set in JSON may be any text; its pin came as UTF-8 bytes and was compared as Latin-1, so the
    node refused the version it serves (503 weight_version_unavailable, the LB retrying to no end)."""
    version = "\u6b65-1"
    assert node.post("/update_weight_version", {"new_version": version}).status_code == 200
    try:
        r = node.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
                      headers={"x-weight-version": version.encode()})
        assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == version, r.text
        r = node.post("/generate", {"input_ids": [1]}, headers={"x-weight-version": b"\xff"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "weight_version_unavailable", r.text
    finally:
        assert node.post("/update_weight_version", {"new_version": "default"}).status_code == 200

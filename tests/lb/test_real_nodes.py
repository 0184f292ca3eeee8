"""The LB in front of real nodes: two sidecars, each in front of its own builtin:tiny engine on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.lb.lbproc import LB, node_args
from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(90)

ADMIN = "real-nodes-admin"
API_KEY = "real-nodes-key"
GREEDY = {"text": "hello there", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def sidecars(proc_log_dir: Path) -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    try:
        for i in range(2):
            engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver",
                                                   "--weights-backup", "cpu"], log_dir=proc_log_dir,
                                   name=f"engine{i}")
            started.append(engine.start())
            sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                                     "--admin-token", ADMIN], log_dir=proc_log_dir,
                                    name=f"sidecar{i}")
            started.append(sidecar.start())
            wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20,
                       what="sidecar ready")
        yield started[1::2]
    finally:
        for proc in reversed(started):
            proc.stop()


def test_a_release_and_resume_cycle_through_the_lb(sidecars: list[ServerProcess], start_lb) -> None:
    lb: LB = start_lb(*node_args(*(s.url for s in sidecars)), "--admin-token", ADMIN, "--api-key", API_KEY,
                      "--health-interval", "30", fast_health=False)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    api = {"Authorization": f"Bearer {API_KEY}"}
    assert all(n["kind"] == "sidecar" and n["engine_kind"] == "handoff" and n["routable"] for n in lb.nodes())

    before = lb.http.post("/generate", json=GREEDY, headers=api)
    assert before.status_code == 200, before.text
    with lb.http.stream("POST", "/generate", json={**GREEDY, "stream": True}, headers=api) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][5:])["meta_info"]["finish_reason"]

    released = lb.http.post("/release_memory_occupation", json={"mode": "wait"}, headers=admin)
    assert released.status_code == 200, released.text
    assert [r["body"]["success"] for r in released.json()["results"]] == [True, True]
    assert all(sorted(r["body"]["released"]) == sorted(["weights", "kv_cache", "cuda_graph", "workspace"])
               for r in released.json()["results"])
    views = lb.nodes()
    assert not any(n["routable"] for n in views) and all(n["health"] == "healthy" for n in views)
    assert all(n["tags"]["weights"]["state"] == "released" for n in views)
    refused = lb.http.post("/generate", json=GREEDY, headers=api)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "no_available_node"
    assert "retry-after" in refused.headers
    assert lb.http.get("/memory_occupation").json()["tags"]["kv_cache"]["released"] == 2

    resumed = lb.http.post("/resume_memory_occupation", json={}, headers=admin)
    assert resumed.status_code == 200, resumed.text
    assert all(n["routable"] for n in lb.nodes())  # no health tick needed: the fan-out checked them
    assert lb.http.get("/flush_cache", headers=admin).status_code == 200
    after = lb.http.post("/generate", json=GREEDY, headers=api)
    assert after.status_code == 200 and after.json()["output_ids"] == before.json()["output_ids"]


def test_a_failing_node_is_named_in_the_502(sidecars: list[ServerProcess], start_lb) -> None:
    lb: LB = start_lb(*node_args(*(s.url for s in sidecars)), "--admin-token", ADMIN)
    answer = lb.http.post("/release_memory_occupation", json={"tags": ["no_such_tag"]},
                          headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 502 and answer.json()["failed"] == 2
    assert {f["status"] for f in answer.json()["failures"]} == {400}
    assert all("no_such_tag" in f["detail"] for f in answer.json()["failures"])
    assert all(n["routable"] for n in lb.nodes())  # a refused release leaves the nodes serving
    with httpx.Client(base_url=lb.url) as client:
        assert client.post("/flush_cache").status_code == 401

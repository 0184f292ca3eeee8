"""One LB in front of a handoff node and a vLLM node: the demo's RL step through the LB, with no request lost.

Clients keep sending SGLang-shaped ``/generate`` requests (streamed and not)
through the whole cycle and retry a 503 after its ``Retry-After``, as an RL
client does; every one of them must end with its full answer. And
``handoff up --engine-kind vllm --model-path DIR`` starts a vLLM-backed cluster.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster
from tests.support.procs import REPO_ROOT, wait_until
from tests.support.sse import iter_events
from tests.vllm.conftest import tokens_lasting

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[72, 101, 108, 108, 111], [82, 76, 32, 105, 115], [1, 2, 3, 4]]


class Load(threading.Thread):
    """Requests through the LB until stopped; a 503 is retried after its Retry-After. Records how each ended."""

    def __init__(self, lb: str, stream: bool, max_new_tokens: int = 40) -> None:
        super().__init__(daemon=True)
        self.lb, self.stream, self.max_new_tokens = lb, stream, max_new_tokens
        self.stop = threading.Event()
        self.completed = 0
        self.refusals = 0
        self.failures: list[str] = []

    def run(self) -> None:
        body = {"input_ids": PROMPTS[0], "stream": self.stream,
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "ignore_eos": True}}
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                try:
                    outcome = self._one(client, body)
                except httpx.HTTPError as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                if outcome == "ok":
                    self.completed += 1
                elif isinstance(outcome, float):
                    self.refusals += 1
                    self.stop.wait(outcome)
                else:
                    self.failures.append(outcome)

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> str | float:
        with client.stream("POST", self.lb + "/generate", json=body) as r:
            if r.status_code == 503 and r.headers.get("retry-after"):
                r.read()
                return min(float(r.headers["retry-after"]), 1.0)
            if r.status_code != 200:
                return f"{r.status_code} {r.read()[:200]!r}"
            if self.stream:
                events = list(iter_events(r))
                last = json.loads(events[-2]) if len(events) > 1 and events[-1] == "[DONE]" else None
            else:
                last = json.loads(r.read())
        if last is None:
            return "a stream ended without [DONE]"
        reason = last["meta_info"]["finish_reason"]["type"]  # SGLang's object on both kinds
        # both kinds' streams repeat the whole answer so far: the last event holds every token
        if last["meta_info"]["completion_tokens"] != self.max_new_tokens or reason != "length":
            return f"cut short: {last['meta_info']['completion_tokens']} tokens, {reason}"
        return "ok"

    def finish(self) -> "Load":
        self.stop.set()
        self.join(300)
        assert not self.is_alive()
        return self


@pytest.fixture(scope="module")
def cluster(checkpoints: tuple[Path, Path], proc_log_dir: Path):
    spec = ClusterSpec(num_mixed=2, model_path=str(checkpoints[0]), engine_kinds=("handoff", "vllm"),
                       weights_backup="disk", lb_args=("--health-interval", "0.2"))
    cluster = LocalCluster(spec, proc_log_dir / "mixed")
    cluster.start(timeout=600)
    yield cluster
    cluster.stop()


def lb_call(cluster: LocalCluster, path: str, body: dict | None = None) -> dict:
    r = httpx.post(cluster.url + path, json={} if body is None else body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def greedy_by_node(cluster: LocalCluster) -> dict[str, tuple[list[list[int]], set[str]]]:
    """Each node's greedy outputs for PROMPTS, asked of its sidecar directly."""
    out = {}
    for node in cluster.nodes:
        r = httpx.post(node.url + "/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY}, timeout=120)
        assert r.status_code == 200, r.text
        out[node.name] = ([a["output_ids"] for a in r.json()], {a["meta_info"]["weight_version"] for a in r.json()})
    return out


def test_release_resume_reload_cycle_through_the_lb_loses_nothing(cluster: LocalCluster,
                                                                     checkpoints: tuple[Path, Path]) -> None:
    nodes = httpx.get(cluster.url + "/nodes", timeout=30).json()["nodes"]
    assert sorted(n["engine_kind"] for n in nodes) == ["handoff", "vllm"]
    lb_call(cluster, "/update_weights_from_disk", {"model_path": str(checkpoints[0]), "weight_version": "step-0"})
    baseline = greedy_by_node(cluster)
    # the same checkpoint in fp32 on both engines: the same greedy tokens, in the same SGLang answer shape
    assert baseline["node0"] == baseline["node1"] and baseline["node0"][1] == {"step-0"}

    tokens = tokens_lasting(cluster.nodes[1].url + "/generate", 4, concurrency=3)  # the vLLM node, the slower
    loads = [Load(cluster.url, stream=True, max_new_tokens=tokens), Load(cluster.url, stream=False,
                                                                           max_new_tokens=tokens),
             Load(cluster.url, stream=True, max_new_tokens=tokens)]
    for load in loads:
        load.start()
    wait_until(lambda: all(load.completed >= 1 for load in loads), timeout=120, what="load running")
    wait_until(lambda: sum(n["in_flight"] or 0 for n in httpx.get(cluster.url + "/nodes").json()["nodes"]) >= 2,
               timeout=60, what="requests in flight on the nodes")
    # the RL step: release everything while requests run, "train", weights back, reload, the rest back, flush
    released = lb_call(cluster, "/release_memory_occupation", {"mode": "wait", "stage_to_cpu": False,
                                                               "drain_timeout": 60})
    bodies = {r["node"]: r["body"] for r in released["results"]}
    assert all(b["released"] == ["weights", "kv_cache", "cuda_graph", "workspace"] for b in bodies.values())
    assert sum(b["drained_requests"] for b in bodies.values()) >= 1  # the load's requests last seconds each
    assert {b["bytes_measured_by"] for b in bodies.values()} == {"engine", "process_rss"}
    # training would run here; the load keeps knocking and gets 503s
    wait_until(lambda: all(load.refusals >= 1 for load in loads), timeout=60, what="503s while released")
    resumed = lb_call(cluster, "/resume_memory_occupation", {"tags": ["weights"]})
    assert all(r["body"]["weights_valid"] is False for r in resumed["results"])  # no backup: reload first
    lb_call(cluster, "/update_weights_from_disk", {"model_path": str(checkpoints[1]), "weight_version": "step-1"})
    lb_call(cluster, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph", "workspace"]})
    lb_call(cluster, "/flush_cache")
    completed_before = [load.completed for load in loads]
    wait_until(lambda: all(load.completed >= n + 2 for load, n in zip(loads, completed_before)), timeout=180,
               what="the load served again")
    step1 = greedy_by_node(cluster)
    assert step1["node0"] == step1["node1"] and step1["node0"][1] == {"step-1"}
    assert step1["node0"][0] != baseline["node0"][0]
    # a cycle with the weights kept in host memory: no reload needed, the same outputs
    lb_call(cluster, "/release_memory_occupation", {"mode": "wait", "stage_to_cpu": True})
    back = lb_call(cluster, "/resume_memory_occupation")
    assert all(r["body"]["weights_valid"] is True for r in back["results"])
    wait_until(lambda: all(n["routable"] for n in httpx.get(cluster.url + "/nodes").json()["nodes"]), timeout=30)
    assert greedy_by_node(cluster) == step1
    for load in loads:
        load.finish()
        assert load.failures == [], load.failures  # 0 lost: every request ended with its whole answer
        assert load.completed >= 3
    assert all(p.is_running() for p in cluster.processes())


def test_handoff_up_starts_a_vllm_cluster(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "handoff", "up", "--engine-kind", "vllm", "--model-path",
                                 str(checkpoints[0]), "--nodes", "1", "--port", "0", "--log-dir",
                                 str(tmp_path / "logs")], stdout=sink, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        text = wait_until(lambda: (t := out.read_text()) and "Ctrl-C" in t and t, timeout=600, what="the banner")
        assert "(vllm)" in text
        lb = re.search(r"LB\s+(http://\S+)", text).group(1)
        # ignore_eos: sampled at temperature 1, the tiny model ends on <eos> within 3 tokens now and then (~0.3%)
        r = httpx.post(lb + "/generate", timeout=120,
                       json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
        nodes = httpx.get(lb + "/nodes", timeout=30).json()["nodes"]
        assert [n["engine_kind"] for n in nodes] == ["vllm"]
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        wait_until(lambda: not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE],
                   timeout=60, what="every child gone")
    finally:
        if proc.poll() is None:  # a failed check: let handoff up stop its cluster, then make sure
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()

"""SGLang's weight sync on a real vLLM node (CPU), through handoff's worker extension: a trainer (this test
process, rank 0 of a gloo group) joins through the LB and broadcasts a checkpoint's weights; the node then
answers exactly as it does after a reload of that checkpoint from disk. Refused updates (a wrong shape, half a
fused layer, a draft model's) load nothing and leave the group in step; a tensor push from this host loads the
same way."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from handoff.cluster.vllm import VllmProcess
from handoff.weight_sync import serialize_named_tensors
from node_engine.model.builtin import builtin_arch, builtin_weights
from tests.lb.lbproc import LB, node_args
from tests.support.procs import ServerProcess, wait_until
from tests.support.trainer import Trainer

LB_HEALTH = ["--health-interval", "0.2", "--health-timeout", "5"]  # as test_vllm_node.py: busy is not down
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3, 4]]


class Node:
    def __init__(self, vllm: VllmProcess, log_dir: Path) -> None:
        self.vllm = vllm
        self.sidecar = ServerProcess("node_sidecar", ["--engine-url", vllm.url, "--engine-poll-interval", "0.2",
                                                      "--vllm-weight-sync-timeout", "30"],
                                     log_dir=log_dir, name="sidecar").start()
        self.lb = LB(ServerProcess("lb", [*LB_HEALTH, *node_args(self.sidecar.url)], log_dir=log_dir,
                                   name="lb").start())
        self.lb.wait_routable([self.sidecar.url], timeout=60)

    def post(self, path: str, body: dict, *, via_lb: bool = False) -> httpx.Response:
        return httpx.post((self.lb.url if via_lb else self.sidecar.url) + path, json=body, timeout=120)

    def greedy(self) -> list[list[int]]:
        # an update drains the node; the LB, which may have seen that, learns the end on its next health check
        self.lb.wait_routable([self.sidecar.url], timeout=30)
        r = self.post("/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY}, via_lb=True)
        assert r.status_code == 200, r.text
        return [item["output_ids"] for item in r.json()]

    def reload(self, folder: Path, version: str) -> None:
        r = self.post("/update_weights_from_disk", {"model_path": str(folder), "weight_version": version})
        assert r.status_code == 200, r.text

    def version(self) -> str:
        return httpx.get(self.sidecar.url + "/get_weight_version", timeout=30).json()["weight_version"]


@pytest.fixture(scope="module")
def node(checkpoints: tuple[Path, Path], proc_log_dir: Path) -> Iterator[Node]:
    vllm = VllmProcess(str(checkpoints[0]), log_dir=proc_log_dir).start()  # with handoff's worker extension
    node = Node(vllm, proc_log_dir)
    wait_until(lambda: httpx.get(node.sidecar.url + "/get_server_info").json().get("weight_sync") is True,
               timeout=60, what="the extension seen")
    yield node
    node.lb.close()
    node.sidecar.stop()
    vllm.stop()


@pytest.fixture(scope="module")
def expected(node: Node, checkpoints: tuple[Path, Path]) -> dict[str, list[list[int]]]:
    """The node's greedy answers after a reload from disk of each checkpoint."""
    node.reload(checkpoints[1], "disk-1")
    trained = node.greedy()
    node.reload(checkpoints[0], "step-0")
    served = node.greedy()
    assert trained != served
    return {"step-0": served, "step-1": trained}


@pytest.fixture
def serving(node: Node, checkpoints: tuple[Path, Path]) -> Iterator[Node]:
    yield node
    assert node.post("/resume_memory_occupation", {}).status_code == 200
    node.reload(checkpoints[0], "step-0")
    wait_until(lambda: httpx.get(node.sidecar.url + "/memory_occupation").json()["serving"], timeout=60)


def step_1() -> dict[str, torch.Tensor]:
    """What ``checkpoints[1]`` holds (seed 1)."""
    return builtin_weights(builtin_arch("builtin:tiny"), 1)


def test_a_trainer_broadcast_through_the_lb_serves_as_a_reload_of_the_same_checkpoint(serving: Node, expected) -> None:
    node, weights = serving, step_1()
    assert node.greedy() == expected["step-0"]
    trainer = Trainer(node.lb.url, world_size=2)
    joined = trainer.join(timeout_s=30)
    assert joined.status_code == 200, joined.text
    assert [r["rank_offset"] for r in joined.json()["results"]] == [1]
    try:
        layer_0 = [(n, t) for n, t in weights.items() if n.startswith("model.layers.0.")]
        rest = [(n, t) for n, t in weights.items() if not n.startswith("model.layers.0.")]
        # half a fused layer (q_proj without k_proj, v_proj): refused, nothing loads, the group stays in step
        r = trainer.push([(n, t) for n, t in layer_0 if n.endswith("q_proj.weight")])
        assert r.status_code == 502 and r.json()["failures"][0]["status"] == 400, r.text
        assert "loads the layer model.layers.0.self_attn.qkv_proj whole" in r.text
        # a wrong shape: refused before anything loads, the old weights keep serving
        name, tensor = rest[0]
        r = trainer.push([(name, tensor[..., :-1].contiguous())])
        assert r.status_code == 502 and "does not match the model's" in r.text, r.text
        # a draft model's (this node has none): refused only once its broadcasts are taken, so the trainer is not
        # left waiting for a receiver until the group's timeout and the group stays in step
        r = trainer.push([(name, tensor)], selector="draft")
        assert r.status_code == 502 and r.json()["failures"][0]["status"] == 400, r.text
        assert "no draft model" in r.text and "received and discarded" in r.text, r.text
        assert node.greedy() == expected["step-0"] and node.version() == "step-0"
        # every tensor, in two updates (one a flattened bucket), as a bucketing trainer sends them
        r = trainer.push(layer_0, flush_cache=False)
        assert r.status_code == 200, r.text
        r = trainer.push(rest, flattened=True, weight_version="pushed-1")
        assert r.status_code == 200, r.text
        assert node.greedy() == expected["step-1"]
        assert node.version() == "pushed-1"
        meta = node.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": GREEDY}).json()["meta_info"]
        assert meta["weight_version"] == "pushed-1"
        assert httpx.get(node.vllm.url + "/weight_info").json() == {"weight_version": "pushed-1"}
    finally:
        left = trainer.leave()
        assert left.status_code == 200, left.text
    r = node.post("/update_weights_from_distributed", {"names": [name], "dtypes": ["float32"],
                                                       "shapes": [list(tensor.shape)]})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]


def test_a_tensor_push_from_this_host_serves_as_the_reload(serving: Node, expected) -> None:
    node, weights = serving, step_1()
    payload = serialize_named_tensors(weights.items())  # shared memory: the tensors live while `weights` does
    begin = node.post("/begin_weight_update", {})
    assert begin.status_code == 200, begin.text
    assert node.post("/begin_weight_update", {}).status_code == 400  # one session at a time
    r = node.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "t-1"})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "t-1" and r.json()["loaded"] == len(weights)
    assert node.post("/end_weight_update", {}).status_code == 200
    assert node.greedy() == expected["step-1"]
    # a payload naming anything but tensors is refused by the restricted unpickler; nothing runs, nothing loads
    evil = node.post("/update_weights_from_tensor", {"serialized_named_tensors": [
        "gASVHwAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOUjAR0cnVllIWUUpQu"]})
    assert evil.status_code == 400 and "not a tensor, a storage" in evil.json()["error"]["message"], evil.text
    assert node.greedy() == expected["step-1"] and node.version() == "t-1"


def _occupation(node: Node) -> dict:
    return httpx.get(node.sidecar.url + "/memory_occupation", timeout=30).json()


def _push(node: Node, tensors: list[tuple[str, torch.Tensor]], **extra: object) -> httpx.Response:
    payload = serialize_named_tensors(tensors)  # shared memory: the tensors live while the caller holds them
    return node.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload], **extra})


def test_buckets_pushed_after_a_level_2_sleep_serve_once_every_weight_is_back(serving: Node, expected) -> None:
    """A level-2 sleep discards the weights; a trainer then pushes a step in buckets (each some of the weights):
    the weights count as valid once the buckets together wrote every one, not only when one bucket held all. A
    refused bucket before them (a wrong shape) changes nothing: the weights stay asleep, released."""
    node, weights = serving, step_1()
    layer_0 = [(n, t) for n, t in weights.items() if n.startswith("model.layers.0.")]
    rest = [(n, t) for n, t in weights.items() if not n.startswith("model.layers.0.")]
    assert node.post("/release_memory_occupation", {"stage_to_cpu": False}).status_code == 200
    wrong = _push(node, [(n, t.flatten()) if n.endswith("q_proj.weight") else (n, t) for n, t in layer_0])
    assert wrong.status_code == 400 and "does not match" in wrong.json()["error"]["message"], wrong.text
    assert "resumed" not in wrong.json()["error"]
    assert all(t["state"] == "released" for t in _occupation(node)["tags"].values())
    assert httpx.get(node.vllm.url + "/is_sleeping", timeout=30).json()["is_sleeping"] is True
    first = _push(node, layer_0)
    assert first.status_code == 200 and first.json()["resumed"] == ["weights"], first.text
    assert first.json()["weights_valid"] is False  # the rest of the model was discarded with the sleep
    last = _push(node, rest, weight_version="bucketed-1")
    assert last.status_code == 200 and last.json()["weights_valid"] is True, last.text
    resumed = node.post("/resume_memory_occupation", {})
    assert resumed.status_code == 200 and resumed.json()["serving"] is True, resumed.text
    assert node.greedy() == expected["step-1"] and node.version() == "bucketed-1"


def test_a_restarted_vllm_stays_stale_until_its_buckets_wrote_every_weight(serving: Node, expected) -> None:
    """vLLM killed and started again after the node's weights were updated: the fresh process serves its start
    checkpoint, so the node holds out (weights_stale) until updates through the sidecar have written every weight
    of that process; the first of a trainer's buckets does not lift it (a mix of both would be served)."""
    node, weights = serving, step_1()
    first = node.vllm.url
    node.vllm.kill()
    wait_until(lambda: _occupation(node)["engine_reachable"] is False, timeout=30, what="the engine seen down")
    node.vllm.start()
    assert node.vllm.url == first
    wait_until(lambda: _occupation(node)["engine_reachable"] and _occupation(node).get("not_serving_reason")
               == "weights_stale", timeout=180, what="the fresh engine held out as stale")
    layer_0 = [(n, t) for n, t in weights.items() if n.startswith("model.layers.0.")]
    rest = [(n, t) for n, t in weights.items() if not n.startswith("model.layers.0.")]
    r = _push(node, layer_0)
    assert r.status_code == 200, r.text
    view = _occupation(node)
    assert view["serving"] is False and view["not_serving_reason"] == "weights_stale", view
    assert node.post("/generate", {"input_ids": PROMPTS[0]}).json()["error"]["type"] == "weights_stale"
    r = _push(node, rest, weight_version="after-restart")
    assert r.status_code == 200, r.text
    wait_until(lambda: _occupation(node)["serving"], timeout=30, what="serving again")
    assert node.greedy() == expected["step-1"] and node.version() == "after-restart"

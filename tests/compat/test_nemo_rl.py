"""NeMo-RL's SGLang calls through the LB, with the bodies its worker sends.

Sources (github.com/NVIDIA-NeMo/RL): ``nemo_rl/models/generation/sglang/sglang_worker.py``
(each HTTP call) and ``sglang_generation.py`` (offload_weights / offload_kv,
onload_weights / onload_kv; ``pause_generation`` with the configured mode,
``retract`` by default in the worker). Its colocated refit: offload the KV cache
and CUDA graphs and the weights for training, then bring the weights back, push
the new ones (a tensor push with a version), and bring back the KV cache and
CUDA graphs. It reads the version from ``/model_info`` first.
"""

from __future__ import annotations

import requests

from handoff.weight_sync import serialize_named_tensors
from tests.compat.conftest import assert_cluster_serves


def make_request(lb: str, endpoint: str, payload: dict | None = None) -> dict:
    response = requests.post(f"{lb}/{endpoint}", json=payload or {}, timeout=120)
    response.raise_for_status()
    return response.json()


def release(lb: str, tags: list[str]) -> None:
    """release_memory_occupation: flush_cache (polled until 200) first."""
    assert requests.get(f"{lb}/flush_cache", timeout=60).status_code == 200
    make_request(lb, "release_memory_occupation", {"tags": tags})


def test_nemo_rl_colocated_refit(cluster, lb, weights, reference) -> None:
    node = cluster.nodes[0].url
    requests.post(f"{lb}/workers", json={"url": node, "worker_type": "regular"}, timeout=30).raise_for_status()
    release(lb, ["kv_cache", "cuda_graph"])   # offload_kv
    release(lb, ["weights"])                  # offload_weights
    # ... training ...
    make_request(lb, "resume_memory_occupation", {"tags": ["weights"]})  # onload_weights
    response = requests.post(f"{lb}/pause_generation", json={"mode": "retract"}, timeout=60)
    response.raise_for_status()
    make_request(lb, "update_weights_from_tensor", {
        "serialized_named_tensors": [serialize_named_tensors(weights["new"].items())], "load_format": None,
        "flush_cache": False, "weight_version": "step-1"})
    requests.post(f"{lb}/continue_generation", json={}, timeout=60).raise_for_status()
    make_request(lb, "resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})  # onload_kv
    for endpoint in ("/model_info", "/get_weight_version"):  # get_weight_version: /model_info first
        response = requests.get(f"{lb}{endpoint}", timeout=30)
        if response.status_code == 200:
            break
    assert response.json()["weight_version"] == "step-1"
    assert_cluster_serves(cluster, reference, version="step-1")

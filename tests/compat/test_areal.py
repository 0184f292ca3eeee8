"""AReaL 1.0.4's weight updates through the LB, with the bodies its client sends.

Sources: ``areal/engine/sglang_remote.py`` (``SGLangBackend``: every request
body) and ``areal/infra/remote_inf_engine.py`` (the order: pause, update,
continue; offload and onload); ``areal/trainer/rl_trainer.py`` for the
colocated order (offload, reload from disk, onload). AReaL talks to one address
here, the LB, as ``server_idx`` 0 with the engines' world size behind it.
AReaL tracks versions on its side: none goes over the wire.
"""

from __future__ import annotations

import requests

from tests.compat.conftest import assert_cluster_serves, greedy
from tests.support.trainer import Trainer

GEN_WORLD_SIZE = 2  # two nodes of one rank each, behind the LB


def post(lb: str, endpoint: str, payload: dict) -> dict:
    """arequest_with_retry: POST json=payload, raise on a non-2xx status."""
    response = requests.post(f"{lb}{endpoint}", json=payload, timeout=120)
    response.raise_for_status()
    return response.json() if response.content else {}


def test_areal_decoupled_distributed_update(cluster, lb, weights, reference) -> None:
    trainer = Trainer(lb, world_size=GEN_WORLD_SIZE + 1, group_name="update_weight_group")
    # build_init_weights_group_request (PP 1): the port as a string, rank_offset 1 + server_idx * tp
    init = {"master_address": "127.0.0.1", "master_port": str(trainer.port), "rank_offset": 1,
            "world_size": GEN_WORLD_SIZE + 1, "backend": "gloo", "group_name": "update_weight_group"}
    assert trainer.join(body=init).status_code == 200
    try:
        post(lb, "/pause_generation", {})  # get_pause_request
        named = list(weights["new"].items())
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": "update_weight_group",
                "abort_all_requests": True}  # build_distributed_weight_update_requests
        assert trainer.push(named, body=body).status_code == 200
        post(lb, "/continue_generation", {})  # get_resume_request
        assert_cluster_serves(cluster, reference, version="default")
    finally:
        trainer.leave()


def test_areal_decoupled_disk_update(cluster, lb, checkpoints, reference) -> None:
    post(lb, "/pause_generation", {})
    post(lb, "/update_weights_from_disk", {"model_path": str(checkpoints["new"]), "abort_all_requests": True})
    post(lb, "/continue_generation", {})
    assert_cluster_serves(cluster, reference, version="default")  # no version given: it stays, as in SGLang
    post(lb, "/update_weight_version", {"new_version": "default"})


def test_areal_colocated_offload_reload_onload(cluster, lb, checkpoints, reference) -> None:
    before = greedy(lb)
    post(lb, "/pause_generation", {})          # _offload_rollout: pause_generation, then offload
    post(lb, "/release_memory_occupation", {})  # get_offload_request
    # ... the trainer trains on the GPUs, saves the checkpoint ...
    post(lb, "/update_weights_from_disk", {"model_path": str(checkpoints["new"]), "abort_all_requests": True})
    post(lb, "/resume_memory_occupation", {})   # get_onload_request (tags None)
    post(lb, "/continue_generation", {})
    assert greedy(lb) != before
    assert_cluster_serves(cluster, reference, version="default")  # no version given: it stays, as in SGLang
    post(lb, "/update_weight_version", {"new_version": "default"})


def test_areal_repeated_offload_and_staged_onload(cluster, lb, checkpoints, reference) -> None:
    """``arequest_with_retry`` sends a call again after a timeout: a second offload or onload succeeds and
    changes nothing; ``onload(tags)`` resumes in stages (weights, then the KV cache)."""
    post(lb, "/pause_generation", {})
    post(lb, "/release_memory_occupation", {})
    post(lb, "/release_memory_occupation", {})
    post(lb, "/update_weights_from_disk", {"model_path": str(checkpoints["new"]), "abort_all_requests": True})
    for tags in (["weights"], ["weights"], ["kv_cache"], None):
        post(lb, "/resume_memory_occupation", {"tags": tags} if tags is not None else {})
    post(lb, "/continue_generation", {})
    assert_cluster_serves(cluster, reference, version="default")
    post(lb, "/update_weight_version", {"new_version": "default"})

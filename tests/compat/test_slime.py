"""slime's calls through the LB, with the bodies its client sends.

Sources (github.com/THUDM/slime): ``slime/backends/sglang_utils/sglang_engine.py``
(registration, offload, onload, the group, updates, versions, shutdown) and
``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py``
(the order: pause, flush, broadcast updates with ``weight_version``, continue;
the group ``slime-pp_0`` with rank offsets ``cumulative + 1``). slime asks for
``backend: nccl``; on CPU the same call names gloo.
"""

from __future__ import annotations

from urllib.parse import quote

import requests

from tests.compat.conftest import assert_cluster_serves
from tests.support.trainer import Trainer


def make_request(lb: str, endpoint: str, payload: dict | None = None) -> dict:
    """SGLangEngine._make_request: POST json=payload or {}, raise_for_status, .json()."""
    response = requests.post(f"{lb}/{endpoint}", json=payload or {}, timeout=120)
    response.raise_for_status()
    return response.json()


def flush_cache(lb: str) -> None:
    for _ in range(60):  # flush_cache polls until 200
        if requests.get(f"{lb}/flush_cache", timeout=60).status_code == 200:
            return
    raise TimeoutError("flush_cache")


def test_slime_offload_onload_and_distributed_update(cluster, lb, weights, reference) -> None:
    node = cluster.nodes[1].url
    # shutdown path of a router >= 0.3: GET /workers, DELETE /workers/{id}; then it registers again
    workers = requests.get(f"{lb}/workers", timeout=30).json()["workers"]
    [worker] = [w for w in workers if w["url"] == node]
    requests.delete(f"{lb}/workers/{worker['id']}", timeout=30).raise_for_status()
    requests.post(f"{lb}/workers", json={"url": node, "worker_type": "regular"}, timeout=30).raise_for_status()
    # older routers and the slime router: /add_worker?url=
    requests.post(f"{lb}/add_worker?url={quote(node, safe=':/')}", timeout=30).raise_for_status()

    # offload: flush_cache, then release everything
    flush_cache(lb)
    make_request(lb, "release_memory_occupation")
    # onload in slime's documented order: weights, then kv_cache and cuda_graph (workspace is not a slime tag)
    make_request(lb, "resume_memory_occupation", {"tags": ["weights"]})
    make_request(lb, "resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})

    # connect_rollout_engines_from_distributed: one engine rank per node, world size = engines + 1
    trainer = Trainer(lb, world_size=3, group_name="slime-pp_0")
    init = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1, "world_size": 3,
            "group_name": "slime-pp_0", "backend": "gloo"}
    assert trainer.join(body=init).status_code == 200
    try:
        # update_weights: pause, flush, buckets with the version, continue
        make_request(lb, "pause_generation")
        flush_cache(lb)
        named = list(weights["new"].items())
        for bucket in (named[: len(named) // 2], named[len(named) // 2:]):
            body = {"names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": "slime-pp_0", "flush_cache": False,
                    "weight_version": "1"}
            assert trainer.push(bucket, body=body).status_code == 200
        make_request(lb, "continue_generation")
        # get_weight_version: GET /get_weight_version -> ["weight_version"]
        response = requests.get(f"{lb}/get_weight_version", timeout=30)
        response.raise_for_status()
        assert response.json()["weight_version"] == "1"
        assert_cluster_serves(cluster, reference, version="1")
    finally:
        trainer.leave()

"""verl 0.9.1's hybrid step through the LB, with the bodies its client sends.

Sources: ``verl/workers/rollout/sglang_rollout/sglang_rollout.py`` (``release``,
``resume``, ``update_weights``) and ``http_server_engine.py`` (the HTTP adapter:
``json=payload`` to ``/<endpoint>``); the tensor payload is what SGLang's
``weight_sync.utils.update_weights`` builds (one ``LocalSerializedTensor`` per
tensor, TP size 1). verl keeps its step count on its side: no weight_version
goes over the wire, so the version stays what it was.
"""

from __future__ import annotations

import requests

from tests.compat.conftest import assert_cluster_serves, greedy
from tests.support.sglang_payloads import verl_payload

BUCKET_BYTES = 64 * 1024  # verl's update_weights_bucket_megabytes, scaled to the tiny model: several buckets


def buckets(weights: dict, limit: int) -> list[list[tuple[str, object]]]:
    """verl's get_named_tensor_buckets: consecutive tensors up to ``limit`` bytes per bucket."""
    out: list[list] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def test_verl_hybrid_step_pushes_tensors_and_ends_serving(cluster, lb, weights, reference) -> None:
    def post(endpoint: str, payload: dict | None) -> dict:
        response = requests.post(f"{lb}/{endpoint}", json=payload or {}, timeout=60)
        response.raise_for_status()
        return response.json()

    before = greedy(lb)
    # rollout.release() at sleep_level 2 (the default): kv_cache and weights
    post("release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    # update_weights(): the server adapter resumes the weights, then pushes bucket by bucket
    post("resume_memory_occupation", {"tags": ["weights"]})
    parts = buckets(weights["new"], BUCKET_BYTES)
    assert len(parts) > 2
    for bucket in parts:
        post("update_weights_from_tensor", {"serialized_named_tensors": [verl_payload(bucket)], "load_format": None,
                                            "flush_cache": True})
    # then flush_cache (GET, retried until 200) and the agent loop's wake-up of the KV cache
    assert requests.get(f"{lb}/flush_cache", timeout=60).status_code == 200
    post("resume_memory_occupation", {"tags": ["kv_cache"]})
    # between steps verl aborts whatever is left: {"rid": "", "abort_all": true}
    post("abort_request", {"rid": "", "abort_all": True})
    assert greedy(lb) != before
    assert_cluster_serves(cluster, reference, version="default")


def read_response(response: requests.Response) -> object:
    """``http_server_engine._read_response``: ``{}`` for no content, JSON, else the text."""
    if response.status_code == 204 or not response.content:
        return {}
    try:
        return response.json()
    except ValueError:
        return {"content_type": response.headers.get("Content-Type", ""), "text": response.text}


def test_the_http_adapters_default_bodies_and_repeated_calls(cluster, lb, weights, reference) -> None:
    """``HttpServerAdapter``'s defaults: ``{"tags": null}`` (everything), ``{"rid": "", "abort_all": false}``;
    its ``_make_request`` sends a call again after a timeout, so a second release or resume must succeed and
    change nothing."""
    def post(endpoint: str, payload: dict) -> object:
        response = requests.post(f"{lb}/{endpoint}", json=payload, timeout=60)
        response.raise_for_status()
        return read_response(response)

    for _ in range(2):
        post("release_memory_occupation", {"tags": None})
    for _ in range(2):
        post("resume_memory_occupation", {"tags": None})
    for _ in range(2):  # the same bucket twice: a retried push
        post("update_weights_from_tensor", {"serialized_named_tensors": [verl_payload(list(weights["new"].items()))],
                                            "load_format": None, "flush_cache": True})
    flushed = requests.get(f"{lb}/flush_cache", timeout=60)
    assert flushed.status_code == 200 and isinstance(read_response(flushed), dict)
    post("abort_request", {"rid": "", "abort_all": False})  # no request named "": nothing aborted
    assert_cluster_serves(cluster, reference, version="default")

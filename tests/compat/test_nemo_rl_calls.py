"""NeMo-RL's SGLang calls (after its rollout refactor) through the LB, with the bodies it builds.

Replayed from github.com/NVIDIA-NeMo/RL at 7ea279ab (2026-08-22):
``nemo_rl/models/generation/sglang/sglang_worker.py`` (``POST /workers {"url", "worker_type": "regular"}`` then
``GET /workers`` every 0.5 s, 5 s timeout, until an entry's ``url`` is the server's; ``_wait_server_healthy``:
``GET /health_generate`` and ``GET /flush_cache`` with ``Content-Type: application/json; charset=utf-8`` and
``Authorization: Bearer None`` (no api key); ``release_memory_occupation``: ``GET /flush_cache`` (not 200 is an
error), then the tags with ``kv_cache`` widened to ``kv_cache`` and ``cuda_graph``; ``shutdown``: ``GET /workers``,
``DELETE /workers/{id}`` of the entry with its url, ``raise_for_status``),
``sglang_generation.py`` (``_build_sampling_params``, ``generate_one_sample``: the payload
``{"sampling_params", "return_logprob": true, "input_ids"}`` over ``httpx.AsyncClient(timeout=None)`` with 3
attempts; tokens and logprobs from ``output_token_logprobs``; truncated when ``finish_reason.type`` is
``length``, ``finish_reason`` read with ``.get(...) or {}``) and ``nemo_rl/models/policy/utils.py``
(``_flush_bucket``: one ``flattened_bucket`` payload per dtype, ``weight_version`` ``str(step)``, the answer's
``success`` (default true) and ``error_message`` or ``message``; then ``GET /flush_cache`` polled for 60 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import types
from typing import Iterator

import httpx
import pytest
import requests

from tests.compat.conftest import assert_cluster_serves
from tests.support.sglang_payloads import b64, flatten_bucket, flattened_payload, serialize

HEADERS = {"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"}
PROMPT = [256] + [ord(c) for c in "NeMo-RL asks"]
CONTEXT_LENGTH = 64


def sampling_params(*, greedy: bool, max_new_tokens: int, stop: list[str] | None = None,
                    stop_token_ids: list[int] | None = None, top_k: int | None = None) -> dict:
    """``_build_sampling_params``: ``top_k`` only when not -1 (1 when greedy); ``stop`` only when non-empty."""
    params: dict = {"temperature": 0.0 if greedy else 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens,
                    "no_stop_trim": True, "spaces_between_special_tokens": False}
    top_k_val = 1 if greedy else (top_k if top_k is not None else -1)
    if top_k_val != -1:
        params["top_k"] = top_k_val
    if stop_token_ids is not None:
        params["stop_token_ids"] = stop_token_ids
    if stop:
        params["stop"] = stop
    return params


async def generate_one_sample(lb: str, params: dict, input_ids: list[int]) -> tuple[list[int], list[float], bool]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        response = await client.post(f"{lb}/generate", json={"sampling_params": params, "return_logprob": True,
                                                               "input_ids": input_ids})
        response.raise_for_status()
        output = response.json()
    meta_info = output["meta_info"]
    if "output_token_logprobs" in meta_info:
        tokens = [item[1] for item in meta_info["output_token_logprobs"]]
        logprobs = [item[0] for item in meta_info["output_token_logprobs"]]
    else:
        tokens, logprobs = [], []
    finish_reason = meta_info.get("finish_reason") or {}
    return tokens, logprobs, finish_reason.get("type") == "length"


def test_nemo_rl_registers_waits_for_its_worker_and_removes_it(cluster, lb) -> None:
    node = cluster.nodes[0].url
    response = requests.post(f"{lb}/workers", json={"url": node, "worker_type": "regular"})
    response.raise_for_status()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # _wait_for_router_registration
        response = requests.get(f"{lb}/workers", timeout=5)
        response.raise_for_status()
        if any(worker.get("url") == node for worker in response.json().get("workers", [])):
            break
        time.sleep(0.5)
    else:
        pytest.fail("the worker never showed in GET /workers")
    for _ in range(2):  # _wait_server_healthy: health_generate, then flush_cache, both until 200
        assert requests.get(f"{node}/health_generate", headers=HEADERS, timeout=30).status_code == 200
        assert requests.get(f"{lb}/flush_cache", headers=HEADERS, timeout=30).status_code == 200
        node = lb  # the same calls through the LB (the URL a user changed)
    # shutdown
    [worker] = [w for w in requests.get(f"{lb}/workers").json()["workers"] if w["url"] == cluster.nodes[0].url]
    requests.delete(f"{lb}/workers/{worker['id']}").raise_for_status()
    assert all(w["url"] != cluster.nodes[0].url for w in requests.get(f"{lb}/workers").json()["workers"])
    requests.post(f"{lb}/workers", json={"url": cluster.nodes[0].url, "worker_type": "regular"}).raise_for_status()


def test_nemo_rl_generation_reads_tokens_logprobs_and_truncation(lb) -> None:
    max_new_tokens = min(6, CONTEXT_LENGTH - len(PROMPT) - 1)
    greedy = sampling_params(greedy=True, max_new_tokens=max_new_tokens)
    tokens, logprobs, truncated = asyncio.run(generate_one_sample(lb, greedy, PROMPT))
    assert len(tokens) == len(logprobs) == max_new_tokens and truncated
    assert all(isinstance(t, int) for t in tokens) and all(lp <= 0 for lp in logprobs)
    again, _, _ = asyncio.run(generate_one_sample(lb, greedy, PROMPT))
    assert again == tokens  # greedy: top_k 1, temperature 0
    # the sampled path: top_k and stop_token_ids from the config, per-sample stop strings
    stop_at = tokens[2]
    sampled = sampling_params(greedy=False, max_new_tokens=max_new_tokens, top_k=1, stop_token_ids=[stop_at],
                              stop=["\x00never"])
    cut, cut_logprobs, cut_truncated = asyncio.run(generate_one_sample(lb, sampled, PROMPT))
    assert cut == tokens[:3] and len(cut_logprobs) == 3 and not cut_truncated  # stops at (and keeps) the id


def test_nemo_rl_http_refit_pushes_flattened_buckets(cluster, lb, weights, reference) -> None:
    def make_request(endpoint: str, payload: dict) -> dict:
        response = requests.post(f"{lb}/{endpoint}", json=payload or {})
        response.raise_for_status()
        return response.json()

    def invalidate_kv_cache() -> None:
        response = requests.get(f"{lb}/flush_cache")
        if response.status_code != 200:
            response.raise_for_status()
            raise RuntimeError(f"flush_cache returned unexpected status {response.status_code}")

    invalidate_kv_cache()  # finish_generation(tags=None): weights, kv_cache + cuda_graph
    make_request("release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
    make_request("resume_memory_occupation", {"tags": ["weights"]})  # prepare_for_generation(tags=["weights"])
    named = list(weights["new"].items())
    for bucket in (named[: len(named) // 2], named[len(named) // 2:]):  # stream_weights_via_http_impl
        payload, keep_alive = flattened_payload(bucket)
        result = make_request("update_weights_from_tensor", {
            "serialized_named_tensors": [payload], "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": str(1)})
        assert result.get("success", True), result.get("error_message") or result.get("message", "unknown error")
        del keep_alive
    for _ in range(60):
        if requests.get(f"{lb}/flush_cache").status_code == 200:
            break
        time.sleep(1)
    else:
        pytest.fail("flush_cache never answered 200")
    make_request("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})  # tags=["kv_cache"]
    assert_cluster_serves(cluster, reference, version="1")


NEMO_TRAIN_UTILS = "nemo_rl.models.generation.sglang.utils.train_utils"


@pytest.fixture
def nemo_metadata_class() -> Iterator[type]:
    """NeMo-RL's own copy of ``FlattenedTensorMetadata`` (``train_utils.py``), pickled under its module's name."""
    parts = NEMO_TRAIN_UTILS.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    added = [name for name in names if name not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    cls = dataclasses.make_dataclass("FlattenedTensorMetadata", ["name", "shape", "dtype", "start_idx", "end_idx",
                                                                 "numel"])
    cls.__module__ = NEMO_TRAIN_UTILS
    sys.modules[NEMO_TRAIN_UTILS].FlattenedTensorMetadata = cls  # type: ignore[attr-defined]
    yield cls
    for name in added:
        del sys.modules[name]


def test_nemo_rl_pushes_its_own_bucket_metadata_class(cluster, lb, weights, reference, nemo_metadata_class) -> None:
    """``_flush_bucket`` builds the bucket with NeMo-RL's ``FlattenedTensorBucket``, so the payload names
    ``nemo_rl...train_utils.FlattenedTensorMetadata``, not SGLang's class."""
    named = list(weights["new"].items())
    bucket = flatten_bucket(named)
    bucket["metadata"] = [nemo_metadata_class(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
                          for m in bucket["metadata"]]
    response = requests.post(f"{lb}/update_weights_from_tensor", json={
        "serialized_named_tensors": [b64(serialize(bucket))], "load_format": "flattened_bucket",
        "flush_cache": False, "weight_version": "1"})
    response.raise_for_status()
    assert response.json().get("success", True)
    assert requests.get(f"{lb}/flush_cache").status_code == 200
    assert_cluster_serves(cluster, reference, version="1")

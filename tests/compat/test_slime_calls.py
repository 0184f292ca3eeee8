"""slime's calls beyond its refit (``test_slime.py``) and its rollouts (``test_slime_rollouts.py``), replayed.

From github.com/THUDM/slime at 624b824a (2026-08-21): ``slime/rollout/sglang_rollout.py`` ``abort`` (``GET
{router}/workers``, then for every worker ``url``: ``slime/backends/sglang_utils/server_control.py``
``abort_server_until_idle``: ``POST {url}/abort_request {"abort_all": true}``, then ``GET
{url}/v1/loads?include=core``, the count read by ``num_requests_from_load`` (``loads[*]``: ``num_reqs``,
``num_total_reqs`` or ``total_reqs``, else ``num_running_reqs`` + ``num_waiting_reqs``), again every 3 s until
0; a failing load read ends the wait at once, with a warning) and ``slime/backends/sglang_utils/sglang_engine.py``
(``health_generate``: ``GET`` with a 5 s timeout, ``raise_for_status``; ``resume_memory_occupation(tags=None)``
sends ``{"tags": null}``; ``update_weights_from_disk``: ``{"model_path"}`` plus ``load_format`` /
``weight_version`` when given; ``get_weight_version``: ``["weight_version"]``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import requests

from tests.compat.conftest import assert_cluster_serves


def num_requests_from_load(load: Any) -> int:
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        value = load.get(key)
        if isinstance(value, int):
            return value
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


def get_loads(url: str) -> dict:
    response = requests.get(f"{url}/v1/loads?include=core", timeout=30)
    response.raise_for_status()  # slime's ``get``: a failure here ends its wait for idle
    return response.json()


def test_slime_abort_ends_every_workers_requests_and_reads_its_load(lb) -> None:
    answers: list[dict] = []
    body = {"input_ids": [256, 115, 108], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 1.0}}
    thread = threading.Thread(target=lambda: answers.append(requests.post(f"{lb}/generate", json=body,
                                                                          timeout=120).json()))
    thread.start()
    urls = [worker["url"] for worker in requests.get(f"{lb}/workers", timeout=30).json()["workers"]]
    deadline = time.monotonic() + 30
    while sum(num_requests_from_load(get_loads(url)) for url in urls) < 1:  # the request is running somewhere
        assert time.monotonic() < deadline, "the running request never showed in /v1/loads"
        time.sleep(0.05)
    for url in urls:
        for _ in range(20):  # abort_server_until_idle
            requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=30)
            if num_requests_from_load(get_loads(url)) <= 0:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"{url} never went idle")
    thread.join(timeout=60)
    assert answers and answers[0]["meta_info"]["finish_reason"]["type"] == "abort"
    loads = get_loads(urls[0])  # SGLang 0.5.23's shape (entrypoints/v1_loads.py, LoadSnapshot.to_dict)
    assert isinstance(loads["timestamp"], str) and isinstance(loads["version"], str)
    assert isinstance(loads["num_accelerators"], int) and "accelerator" in loads
    [core] = loads["loads"]
    assert core["dp_rank"] == 0 and core["num_running_reqs"] == core["num_waiting_reqs"] == 0
    assert {"memory", "queues"}.isdisjoint(core)  # include=core: the flat fields only
    assert requests.get(f"{urls[0]}/v1/loads?include=nonsense", timeout=30).status_code == 400


def test_slime_health_resume_all_and_reload_from_disk(cluster, lb, checkpoints, reference) -> None:
    def make_request(endpoint: str, payload: dict | None = None) -> dict:
        response = requests.post(f"{lb}/{endpoint}", json=payload or {})
        response.raise_for_status()
        return response.json()

    requests.get(f"{lb}/health_generate", timeout=5.0).raise_for_status()
    make_request("release_memory_occupation")
    make_request("resume_memory_occupation", {"tags": None})  # resume_memory_occupation() with no tags
    make_request("update_weights_from_disk", {"model_path": str(checkpoints["new"]), "weight_version": "7"})
    response = requests.get(f"{lb}/get_weight_version")
    response.raise_for_status()
    assert response.json()["weight_version"] == "7"
    requests.get(f"{lb}/health_generate", timeout=5.0).raise_for_status()
    assert_cluster_serves(cluster, reference, version="7")

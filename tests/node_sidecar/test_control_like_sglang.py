"""The sidecar's control calls where SGLang 0.5.23's behaviour is easy to miss (``tokenizer_manager.py``), on a
real engine: requests wait through a pause or a weight update instead of failing; ``abort_all_requests`` aborts
paused requests too; an update is never blocked by requests only it can let run; SGLang's field semantics."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until
from tests.support.streams import start_clients
from tests.support.weights import save_tiny, tiny_weights

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("ck"), tiny_weights(1))


@pytest.fixture
def node(proc_log_dir: Path) -> Iterator[httpx.Client]:
    """A fresh engine (memory saver, no backup) and its sidecar; the client talks to the sidecar."""
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver"],
                           log_dir=proc_log_dir, name="engine")
    engine.start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2"],
                            log_dir=proc_log_dir, name="sidecar")
    sidecar.start()
    try:
        with httpx.Client(base_url=sidecar.url, timeout=60) as client:
            yield client
    finally:
        sidecar.stop()
        engine.stop()


def stream(client: httpx.Client, tokens: int) -> list:
    clients = start_clients(str(client.base_url) + "/generate", {
        "text": "go", "stream": True, "sampling_params": dict(GREEDY, max_new_tokens=tokens)}, 1, timeout=100)
    assert clients[0].started_streaming.wait(20)
    return clients


def test_requests_during_a_pause_wait_for_the_continue_past_the_old_hold_cap(node: httpx.Client) -> None:
    assert node.post("/pause_generation", json={"mode": "abort"}).status_code == 200

    async def three_hundred() -> list[int]:
        async with httpx.AsyncClient(base_url=node.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=400)) as client:
            body = {"text": "x", "sampling_params": dict(GREEDY, max_new_tokens=1)}
            sent = [asyncio.create_task(client.post("/generate", json=body)) for _ in range(300)]
            deadline = asyncio.get_running_loop().time() + 30
            while (held := (await client.get("/memory_occupation")).json()["held"]) < 300:
                assert asyncio.get_running_loop().time() < deadline, f"only {held} of 300 requests held"
                await asyncio.sleep(0.05)
            assert (await client.post("/continue_generation")).status_code == 200
            return [r.status_code for r in await asyncio.gather(*sent)]
    assert asyncio.run(asyncio.wait_for(three_hundred(), 60)) == [200] * 300  # 256 held, 44 got 503 before


def test_a_request_during_a_weight_update_waits_for_it(node: httpx.Client, checkpoint: Path) -> None:
    running = stream(node, 1200)
    with ThreadPoolExecutor(2) as pool:
        update = pool.submit(node.post, "/update_weights_from_disk",
                             json={"model_path": str(checkpoint), "weight_version": "v1"})
        wait_until(lambda: node.get("/memory_occupation").json()["admission"] == "holding", timeout=10,
                   what="the update draining")
        later = pool.submit(node.post, "/generate",
                            json={"text": "y", "sampling_params": dict(GREEDY, max_new_tokens=2)})
        wait_until(lambda: node.get("/memory_occupation").json()["held"] == 1, timeout=10, what="the request held")
        assert update.result(60).status_code == 200
        answer = later.result(60)
    assert answer.status_code == 200 and answer.json()["meta_info"]["weight_version"] == "v1"
    assert running[0].finish(60).status == 200


def test_abort_all_requests_aborts_paused_requests_too(node: httpx.Client, checkpoint: Path) -> None:
    running = stream(node, 3000)
    assert node.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    r = node.post("/update_weights_from_disk", json={"model_path": str(checkpoint), "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["aborted_requests"] == 1, r.text
    assert running[0].finish(30).finish_reason == "abort"
    assert node.post("/continue_generation").status_code == 200


def test_an_update_is_not_blocked_by_requests_only_it_lets_run(node: httpx.Client, checkpoint: Path) -> None:
    running = stream(node, 3000)
    assert node.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert node.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert node.post("/continue_generation").status_code == 200
    assert node.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200  # no backup
    r = node.post("/update_weights_from_disk", json={"model_path": str(checkpoint), "drain_timeout": 3})
    assert r.status_code == 200 and r.json()["weights_valid"] is True, r.text  # was 409 drain_timeout, forever
    result = running[0].finish(60)
    assert result.status == 200 and result.finish_reason == "length"


def test_sglang_field_semantics(node: httpx.Client, checkpoint: Path) -> None:
    bad = node.post("/update_weights_from_disk", json={"model_path": str(checkpoint) + "\u0000x"})
    assert bad.status_code == 400 and "NUL" in bad.json()["error"]["message"], bad.text
    before = node.get("/memory_occupation").json()["weight_version"]
    kept = node.post("/update_weights_from_disk", json={"model_path": str(checkpoint), "keep_pause": True})
    assert kept.status_code == 200 and kept.json()["weight_version"] == before  # no version given: it stays
    assert node.get("/ready").status_code == 200  # keep_pause changes nothing, as in SGLang
    assert node.post("/abort_request", json={"rid": None, "abort_all": True}).status_code == 200

"""Tensor pushes a sidecar refuses before its engine reads them, on real processes: the sender's shared memory
must not stay behind (torch counts one reader per serialized CPU tensor; the reader releases the sender's
reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from handoff.weight_sync import serialize_named_tensors
from tests.support.procs import ServerProcess, wait_until
from tests.support.streams import start_clients
from tests.support.weights import greedy, tiny_weights

pytestmark = pytest.mark.timeout(180)
NAME = "model.norm.weight"


@pytest.fixture(scope="module")
def node(proc_log_dir: Path) -> Iterator[str]:
    """A sidecar (drain bounded at 0.3 s) in front of a real engine: its URL."""
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=proc_log_dir, name="engine")
    engine.start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                             "--drain-timeout", "0.3"], log_dir=proc_log_dir, name="sidecar")
    sidecar.start()
    wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="sidecar ready")
    yield sidecar.url
    sidecar.stop()
    engine.stop()


def _shm_file(tensor: torch.Tensor) -> Path:
    """Where a tensor serialized with the ``file_system`` strategy lives (its storage is in shared memory now)."""
    _, handle, _ = tensor.untyped_storage()._share_filename_cpu_()
    return Path("/dev/shm") / handle.decode().lstrip("/")


def _refused_push_leaves_nothing(url: str, status: int, kind: str, **fields: object) -> None:
    """A push of a fresh tensor refused with ``status`` / ``kind``: once the sender lets go of its tensor, the
    shared memory is gone."""
    tensor = tiny_weights(5)[NAME].clone()
    payload = serialize_named_tensors([(NAME, tensor)])
    shm = _shm_file(tensor)
    before = greedy(url)
    r = httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload], **fields},
                   timeout=60)
    assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
    assert shm.exists()
    del tensor
    wait_until(lambda: not shm.exists(), timeout=10, what=f"{shm} unlinked once the sender let go")
    assert greedy(url) == before  # nothing was loaded


def test_a_push_refused_for_a_bad_field_leaves_no_shared_memory_behind(node: str) -> None:
    _refused_push_leaves_nothing(node, 400, "invalid_request", weight_version=5)


def test_a_push_refused_by_a_drain_that_timed_out_leaves_no_shared_memory_behind(node: str) -> None:
    stream = {"text": "stream me", "stream": True,
              "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2000}}
    clients = start_clients(node + "/generate", stream, 1)
    wait_until(lambda: httpx.get(node + "/memory_occupation").json()["in_flight"] == 1, timeout=10,
               what="a generation in flight")
    try:
        _refused_push_leaves_nothing(node, 409, "drain_timeout")
    finally:
        httpx.post(node + "/abort_request", json={"rid": "", "abort_all": True}, timeout=30)
        for client in clients:
            client.finish(30)


def test_a_dry_run_reads_the_payload_and_loads_nothing(node: str) -> None:
    tensor = tiny_weights(5)[NAME].clone()
    shm = _shm_file(tensor)
    before = greedy(node)
    r = httpx.post(node + "/update_weights_from_tensor", timeout=60, json={
        "serialized_named_tensors": [serialize_named_tensors([(NAME, tensor)])], "dry_run": True})
    assert r.status_code == 200 and r.json()["dry_run"] is True, r.text
    del tensor
    wait_until(lambda: not shm.exists(), timeout=10, what=f"{shm} unlinked once the sender let go")
    assert greedy(node) == before
    bad = torch.zeros(3)
    r = httpx.post(node + "/update_weights_from_tensor", timeout=60, json={
        "serialized_named_tensors": [serialize_named_tensors([(NAME, bad)])], "dry_run": True})
    assert r.status_code == 400 and NAME in r.json()["error"]["message"], r.text


def test_a_push_the_engine_refuses_for_its_selector_leaves_no_shared_memory_behind(node: str) -> None:
    """The engine refused a draft selector before it read the payload."""
    _refused_push_leaves_nothing(node, 400, "invalid_request", selector="draft")

"""Tensor pushes a sidecar refuses before its engine reads them, on real processes: the sender's shared memory
must not stay behind (torch counts one reader per serialized CPU tensor; the reader releases the sender's
reference)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import json
import socket

import httpx
import pytest
import torch

from handoff.protocol.control import DEADLINE_HEADER
from handoff.weight_sync import serialize_named_tensors
from tests.support.procs import ServerProcess, wait_until
from tests.support.streams import start_clients
from tests.support.weights import greedy, tiny_weights

pytestmark = pytest.mark.timeout(180)
NAME = "model.norm.weight"


@pytest.fixture(scope="module")
def engine(proc_log_dir: Path) -> Iterator[ServerProcess]:
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=proc_log_dir, name="engine")
    engine.start()
    yield engine
    engine.stop()


def _sidecar(engine: ServerProcess, log_dir: Path, name: str, *flags: str) -> ServerProcess:
    """A sidecar (drains bounded at 120 s; a test that wants one cut short sends a deadline) in front of
    ``engine``, ready."""
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                             "--drain-timeout", "120", *flags], log_dir=log_dir, name=name)
    sidecar.start()
    wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="sidecar ready")
    return sidecar


@pytest.fixture(scope="module")
def node(engine: ServerProcess, proc_log_dir: Path) -> Iterator[str]:
    """A sidecar in front of the real engine: its URL."""
    sidecar = _sidecar(engine, proc_log_dir, "sidecar")
    yield sidecar.url
    sidecar.stop()


def _shm_file(tensor: torch.Tensor) -> Path:
    """Where a tensor serialized with the ``file_system`` strategy lives (its storage is in shared memory now)."""
    _, handle, _ = tensor.untyped_storage()._share_filename_cpu_()
    return Path("/dev/shm") / handle.decode().lstrip("/")


def _refused_push_leaves_nothing(url: str, status: int, kind: str, *, headers: dict[str, str] | None = None,
                                 **fields: object) -> None:
    """A push of a fresh tensor refused with ``status`` / ``kind``: once the sender lets go of its tensor, the
    shared memory is gone."""
    tensor = tiny_weights(5)[NAME].clone()
    payload = serialize_named_tensors([(NAME, tensor)])
    shm = _shm_file(tensor)
    before = greedy(url)
    r = httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload], **fields},
                   headers=headers, timeout=60)
    assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
    assert shm.exists()
    del tensor
    wait_until(lambda: not shm.exists(), timeout=10, what=f"{shm} unlinked once the sender let go")
    assert greedy(url) == before  # nothing was loaded


def test_a_push_refused_for_a_bad_field_leaves_no_shared_memory_behind(node: str) -> None:
    _refused_push_leaves_nothing(node, 400, "invalid_request", weight_version=5)


@contextmanager
def _a_long_generation(url: str, *, abort_url: str | None = None) -> Iterator[None]:
    """A generation in flight through ``url`` for the block (ended by an abort through ``abort_url`` after it)."""
    stream = {"text": "stream me", "stream": True,
              "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2000}}
    clients = start_clients(url + "/generate", stream, 1)
    wait_until(lambda: _occupation(url)["in_flight"] == 1, timeout=10, what="a generation in flight")
    try:
        yield
    finally:
        httpx.post((abort_url or url) + "/abort_request", json={"rid": "", "abort_all": True}, timeout=30)
        for client in clients:
            client.finish(30)


def _occupation(url: str) -> dict[str, Any]:
    return httpx.get(url + "/memory_occupation", timeout=10).json()


def test_a_push_refused_by_a_drain_that_timed_out_leaves_no_shared_memory_behind(node: str) -> None:
    with _a_long_generation(node):
        _refused_push_leaves_nothing(node, 409, "drain_timeout", headers={DEADLINE_HEADER: "1"})


def _push_left_waiting_on_a_drain(url: str, tensor: torch.Tensor) -> socket.socket:
    """A push of ``tensor`` sent on a connection of its own, once it waits on the drain of a generation."""
    body = json.dumps({"serialized_named_tensors": [serialize_named_tensors([(NAME, tensor)])]}).encode()
    host, port = url[len("http://"):].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(f"POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: _occupation(url)["admission"] == "holding", timeout=10, what="the push waiting on a drain")
    return conn


def test_a_push_whose_client_left_during_the_drain_leaves_no_shared_memory_behind(node: str) -> None:
    """Its client leaving does not cut a push (as in SGLang): it loads once the drain is done, which reads it."""
    tensor = tiny_weights(5)[NAME].clone()
    shm = _shm_file(tensor)
    with _a_long_generation(node):
        _push_left_waiting_on_a_drain(node, tensor).close()
    wait_until(lambda: _occupation(node)["admission"] == "open", timeout=30, what="the push done")
    assert shm.exists()
    del tensor
    wait_until(lambda: not shm.exists(), timeout=10, what=f"{shm} unlinked once the sender let go")


def test_a_push_cut_by_a_shutdown_during_the_drain_leaves_no_shared_memory_behind(
        node: str, engine: ServerProcess, proc_log_dir: Path) -> None:
    """Past ``--shutdown-timeout`` the sidecar cancels the push; it has the engine read the payload before it
    exits."""
    cut = _sidecar(engine, proc_log_dir, "sidecar-cut", "--shutdown-timeout", "1")
    tensor = tiny_weights(5)[NAME].clone()
    shm = _shm_file(tensor)
    before = greedy(node)
    try:
        with _a_long_generation(cut.url, abort_url=node), _push_left_waiting_on_a_drain(cut.url, tensor) as conn:
            assert cut.stop(30) == 0
            assert b" 503 " in conn.recv(65536).split(b"\r\n", 1)[0]
    finally:
        cut.stop()
    assert shm.exists()
    del tensor
    wait_until(lambda: not shm.exists(), timeout=10, what=f"{shm} unlinked once the sender let go")
    assert greedy(node) == before  # nothing was loaded


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

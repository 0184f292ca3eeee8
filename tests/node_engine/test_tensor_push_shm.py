"""``update_weights_from_tensor`` payloads that are torch's own but lie about the shared memory behind them,
pushed by a hostile process on the engine's host to a real engine process: the manager socket and the segment a
CPU tensor names are the sender's to choose."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.procs import tiny_engine
from tests.support.sglang_payloads import b64, serialize
from tests.support.weights import greedy, tiny_weights

NAME = "model.norm.weight"


@pytest.fixture(scope="module")
def engine(proc_log_dir: Path):
    yield from tiny_engine(proc_log_dir, "shm")


def _replace(raw: bytes, old: bytes, new: bytes) -> bytes:
    """``raw`` with the SHORT_BINBYTES ``old`` (torch's handle or manager path) replaced by ``new``."""
    at = raw.index(old)
    assert raw[at - 2:at - 1] == b"C" and raw[at - 1] == len(old) and len(new) < 256
    return raw[:at - 1] + bytes([len(new)]) + new + raw[at + len(old):]


def _shm_in(pid: int) -> list[str]:
    """The engine's mappings and open files of torch segments."""
    found = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/torch_" in line]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since it was listed
            continue
        found += [target] if "/torch_" in target else []
    return found


def _push(url: str, raw: bytes, **fields) -> httpx.Response:
    body = {"serialized_named_tensors": [b64(raw)], "release_sender_reference": False, **fields}
    return httpx.post(url + "/update_weights_from_tensor", timeout=30, json=body)


@pytest.mark.parametrize("lie", ["segment smaller than torch maps", "symlink in /dev/shm"])
def test_a_segment_that_is_not_torchs_is_400_and_left_as_it_was(engine, tmp_path: Path, lie: str) -> None:
    """A regular file named as torch's segment but without torch's header room (the bytes claimed, no more) was
    mapped: torch grew the file to fit its header and the tensor read what it held. A refusal by torch
    itself (a symlink) answered its C++ backtrace."""
    before = greedy(engine.url)
    tensor = tiny_weights(3)[NAME]
    raw = serialize([(NAME, tensor)])
    claimed = tensor.numel() * tensor.element_size()
    handle = re.search(rb"/torch_\d+_\d+_\d+", raw).group(0)
    fake = Path("/dev/shm") / f"torch_{os.getpid()}_77_{len(lie)}"
    target = tmp_path / "target"
    target.write_bytes(b"\1" * claimed)
    if lie == "symlink in /dev/shm":
        fake.symlink_to(target)
    else:
        shutil.copyfile(target, fake)
    try:
        r = _push(engine.url, _replace(raw, handle, b"/" + fake.name.encode()), weight_version="lied")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
        message = r.json()["error"]["message"]
        assert "frame #" not in message and len(message) < 1000, message
        assert fake.is_symlink() or fake.stat().st_size == claimed
        assert target.stat().st_size == claimed
    finally:
        fake.unlink()
    assert greedy(engine.url) == before
    assert httpx.get(engine.url + "/get_weight_version").json()["weight_version"] == "default"
    assert _shm_in(engine.proc.pid) == []


def test_a_refused_push_of_real_segments_leaves_nothing_mapped(engine) -> None:
    """Segments mapped for a payload refused after the unpickle (a name the model lacks, one listed twice) are let
    go with the refusal: no mapping or descriptor of them stays in the engine."""
    before = greedy(engine.url)
    weights = tiny_weights(4)
    named = [(NAME, weights[NAME]), (NAME, weights[NAME].clone()), ("model.no_such.weight", weights[NAME])]
    r = _push(engine.url, serialize(named), release_sender_reference=True)
    assert r.status_code == 400 and "listed twice" in r.text and "unknown weight" in r.text, r.text
    assert _shm_in(engine.proc.pid) == []
    assert greedy(engine.url) == before


def test_a_manager_socket_that_never_answers_does_not_stop_the_engine(engine) -> None:
    """torch registers a mapped segment with the manager socket the payload names, connecting while it holds the
    GIL and with no timeout: a socket of the sender's whose backlog is full froze the whole engine process (no
    answer to anything, ever). The engine now registers with a manager of its own and never dials the payload's."""
    folder = tempfile.mkdtemp(prefix="evil-", dir="/tmp")  # a socket's path has at most 107 bytes
    listener = socket.socket(socket.AF_UNIX)
    queued = []
    try:
        path = os.path.join(folder, "manager.sock")
        listener.bind(path)
        listener.listen(0)
        while True:  # never accepted: the backlog fills, and one more connect blocks
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            try:
                client.connect(path)
            except BlockingIOError:
                client.close()
                break
            queued.append(client)
        new = tiny_weights(5)[NAME]
        raw = serialize([(NAME, new)])
        manager = re.search(rb"/[^\0]*/manager\.sock", raw).group(0)
        r = _push(engine.url, _replace(raw, manager, path.encode()), weight_version="pushed")
        assert r.status_code == 200, r.text
        assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
        assert httpx.get(engine.url + "/get_weight_version").json()["weight_version"] == "pushed"
    finally:
        for client in queued:
            client.close()
        listener.close()
        shutil.rmtree(folder)


def _segments_mapped(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/torch_" in line}


def test_concurrent_pushes_map_one_payload_at_a_time(engine) -> None:
    """Each push decodes on a thread of its own and its tensors stay mapped until its commit: concurrent hostile
    payloads of distinct segments (up to 16,384 each) held them all at once, past ``vm.max_map_count`` with a few.
    Weight updates now stage one at a time (SGLang's model-update lock): the others wait for the slot."""
    num_segments, num_pushes = 8, 3
    payloads, keep = [], []
    for push in range(num_pushes):  # distinct tensors, each a shared-memory segment, then slow pickle operations
        tensors = [torch.full((4,), float(push * num_segments + i)) for i in range(num_segments)]
        keep += tensors
        payloads.append(serialize([*((f"w{i}", t) for i, t in enumerate(tensors)), [0] * 800_000]))
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda raw=raw: answers.append(_push(engine.url, raw)), daemon=True)
               for raw in payloads]
    for thread in threads:
        thread.start()
    most, deadline = 0, time.monotonic() + 60
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        most = max(most, len(_segments_mapped(engine.proc.pid)))
        time.sleep(0.01)  # sampling the engine's mappings, not waiting for an event
    for thread in threads:
        thread.join(10)
    assert len(answers) == num_pushes and all(r.status_code == 400 for r in answers), [r.text for r in answers]
    assert all("(name, tensor) pair" in r.json()["error"]["message"] for r in answers)
    assert 0 < most <= num_segments, most
    assert _shm_in(engine.proc.pid) == []

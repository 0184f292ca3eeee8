"""A client that stops reading its stream, and an abort-mode release (review, stop 45).

The in-flight count of a stream drops when its relay ends; a relay blocked in a send to a client whose receive
window is closed never ends before the generation deadline (an hour by default). An abort-mode release ended the
request in the engine (idle at once) and then waited for that client: 409 ``drain_timeout``, nothing released, and
``/v1/loads`` said ``num_running_reqs`` 1 (slime's abort loop waits for 0).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(90)

BODY = {"text": "stream me", "stream": True, "return_logprob": True, "top_logprobs_num": 20,
        "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4000}}


def _send_queue(local_port: int, remote_port: int) -> int:
    """The bytes the kernel holds unsent on the socket from ``local_port`` to ``remote_port`` (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == remote_port:
            return int(queues.split(":")[0], 16)
    return 0


def _stops_growing(read: Callable[[], int], still_s: float = 0.5) -> Callable[[], bool]:
    """A predicate true once ``read()`` is above 0 and the same for ``still_s``."""
    last: list[float] = [0, 0.0]  # value, when it was first seen

    def check() -> bool:
        value, now = read(), time.monotonic()
        if value != last[0]:
            last[:] = [value, now]
        return value > 0 and now - last[1] >= still_s

    return check


def _reader_that_stops(url: str) -> socket.socket:
    """A stream asked on a connection whose client never reads (a receive window of a few KiB, soon closed)."""
    host, port = url[len("http://"):].rsplit(":", 1)
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.settimeout(30)
    conn.connect((host, int(port)))
    body = json.dumps(BODY).encode()
    conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    return conn


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's send queue from /proc/net/tcp")
def test_an_abort_release_is_not_held_by_a_client_that_stopped_reading(proc_log_dir: Path) -> None:
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver",
                                           "--weights-backup", "cpu"],
                           log_dir=proc_log_dir, name="engine-stalled-reader").start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2"],
                            log_dir=proc_log_dir, name="sidecar-stalled-reader").start()
    conn = None
    try:
        wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="ready")
        conn = _reader_that_stops(sidecar.url)
        sidecar_port, client_port = int(sidecar.url.rsplit(":", 1)[1]), conn.getsockname()[1]
        # the sidecar's kernel queue to the client is full (what it holds unsent no longer grows): the relay's
        # sends wait on the client from here on
        wait_until(_stops_growing(lambda: _send_queue(sidecar_port, client_port)), timeout=30,
                   what="the client's window closed")
        released = httpx.post(sidecar.url + "/release_memory_occupation", json={"mode": "abort", "drain_timeout": 5},
                              timeout=30)
        assert released.status_code == 200, released.text
        assert released.json()["aborted_requests"] == 1
        loads = httpx.get(sidecar.url + "/v1/loads").json()["loads"][0]
        assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0
        assert httpx.post(sidecar.url + "/resume_memory_occupation", json={}, timeout=30).status_code == 200
        wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="serving again")
        again = httpx.post(sidecar.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}},
                           timeout=30)
        assert again.status_code == 200, again.text
    finally:
        if conn is not None:
            conn.close()
        sidecar.stop()
        engine.stop()

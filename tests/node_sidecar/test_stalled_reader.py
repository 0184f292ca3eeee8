"""A client that stops reading its stream, and an abort-mode release (review, stop 45).

The in-flight count of a stream drops when its relay ends; a relay blocked in a send to a client whose receive
window is closed never ends before the generation deadline (an hour by default). An abort-mode release ended the
request in the engine (idle at once) and then waited for that client: 409 ``drain_timeout``, nothing released, and
``/v1/loads`` said ``num_running_reqs`` 1 (slime's abort loop waits for 0).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until
from tests.support.stalled_client import client_that_never_reads, send_queue, stops_growing

pytestmark = pytest.mark.timeout(90)

BODY = {"text": "stream me", "stream": True, "return_logprob": True, "top_logprobs_num": 20,
        "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4000}}


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
        conn = client_that_never_reads(sidecar.url, BODY)
        sidecar_port, client_port = int(sidecar.url.rsplit(":", 1)[1]), conn.getsockname()[1]
        # the sidecar's kernel queue to the client is full (what it holds unsent no longer grows): the relay's
        # sends wait on the client from here on
        wait_until(stops_growing(lambda: send_queue(sidecar_port, client_port)), timeout=30,
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

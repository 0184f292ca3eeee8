"""A client that stops reading a non-stream answer (review, stop 46).

A non-stream answer is read whole from the engine, then written to the client. Before the fix it was handed to
the connection in one write: the sidecar's count of it (in flight, ``--max-inflight-bytes``) ended there while the
bytes the client did not take stayed in the process's memory until it read them or left (an hour, a day: nothing
cut them), and a request pipelined behind it waited on that connection with its place in flight held and no
deadline at all, so an abort-mode release answered 409 ``drain_timeout``.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until
from tests.support.stalled_client import client_that_never_reads, wait_stalled

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")]

# about 5 MB of answer (eight prompts, 1000 tokens each with 20 top logprobs): more than the kernel's queues hold
LARGE = {"text": ["answer me"] * 8, "return_logprob": True, "top_logprobs_num": 20,
         "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1000}}
SMALL = {"text": "a", "sampling_params": {"max_new_tokens": 2}}


def _start(log_dir: Path, name: str, *sidecar_args: str) -> tuple[ServerProcess, ServerProcess]:
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--enable-memory-saver",
                                           "--weights-backup", "cpu"], log_dir=log_dir, name=f"engine-{name}").start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                             *sidecar_args], log_dir=log_dir, name=f"sidecar-{name}").start()
    wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="ready")
    return engine, sidecar


def test_an_abort_release_is_not_held_by_an_answer_pipelined_behind_one_never_read(proc_log_dir: Path) -> None:
    engine, sidecar = _start(proc_log_dir, "pipelined-answer")
    conn = None
    try:
        conn = client_that_never_reads(sidecar.url, LARGE, SMALL)
        wait_stalled(sidecar.url, conn)
        wait_until(lambda: httpx.get(sidecar.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 1,
                   timeout=30, what="one answer waiting on its client")
        released = httpx.post(sidecar.url + "/release_memory_occupation", json={"mode": "abort", "drain_timeout": 4},
                              timeout=30)
        assert released.status_code == 200, released.text
        assert released.json()["aborted_requests"] == 1
        loads = httpx.get(sidecar.url + "/v1/loads").json()["loads"][0]
        assert loads["num_running_reqs"] == 0
        assert httpx.post(sidecar.url + "/resume_memory_occupation", json={}, timeout=30).status_code == 200
        wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="serving again")
        assert httpx.post(sidecar.url + "/generate", json=SMALL, timeout=30).status_code == 200
    finally:
        if conn is not None:
            conn.close()
        sidecar.stop()
        engine.stop()


def test_an_answer_never_read_stays_counted_in_the_inflight_bytes(proc_log_dir: Path) -> None:
    """Eight MiB of answers at once: one ~5 MB answer its client does not read holds its bytes, so a second one
    (read at once) is the 502 naming the flag; a ``wait`` release waits for it (as for a stream) no longer than its
    ``drain_timeout``; once the first client leaves, the second passes."""
    engine, sidecar = _start(proc_log_dir, "unread-answer-bytes", "--max-body-bytes", str(1 << 20),
                             "--max-inflight-bytes", str(8 << 20))
    conn = None
    try:
        conn = client_that_never_reads(sidecar.url, LARGE)
        wait_stalled(sidecar.url, conn)
        second = httpx.post(sidecar.url + "/generate", json=LARGE, timeout=60)
        assert second.status_code == 502, (second.status_code, len(second.content))
        assert "--max-inflight-bytes" in second.json()["error"]["message"]
        started = time.monotonic()
        waited = httpx.post(sidecar.url + "/release_memory_occupation", json={"mode": "wait", "drain_timeout": 1},
                            timeout=30)
        assert waited.status_code == 409 and waited.json()["error"]["type"] == "drain_timeout", waited.text
        assert time.monotonic() - started < 3
        conn.close()
        conn = None
        wait_until(lambda: httpx.get(sidecar.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 0,
                   timeout=30, what="the first answer given up")
        third = httpx.post(sidecar.url + "/generate", json=LARGE, timeout=60)
        assert third.status_code == 200, third.text[:300]
        assert len(third.content) > (4 << 20)
    finally:
        if conn is not None:
            conn.close()
        sidecar.stop()
        engine.stop()

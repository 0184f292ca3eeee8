"""A node stopped as Kubernetes stops a pod (SIGTERM to the engine and the sidecar at once): streams in flight
finish within ``--shutdown-timeout``; new connections are refused at once; bad addresses exit 2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import REPO_ROOT, ServerProcess, wait_until
from tests.support.streams import start_clients

pytestmark = pytest.mark.timeout(90)

GRACE = ["--shutdown-timeout", "30"]
STALL_S = 7  # the engine thread's stall when the node is stopped: past uvicorn's default grace of 5 s
NUM_TOKENS = 1500  # each stream's length: still decoding when the stall is armed, done well within the grace


def test_streams_in_flight_finish_when_the_node_is_stopped(proc_log_dir: Path) -> None:
    """The streams outlive uvicorn's default grace (5 s) by construction: the engine thread is held in a stall
    (the fault drill) when the signals go, so the test does not depend on how fast this machine decodes."""
    drill = proc_log_dir / "shutdown_drill.json"
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--incremental-streaming-output",
                                           "--fault-drill-file", str(drill), *GRACE], log_dir=proc_log_dir,
                           name="stopped_engine")
    engine.start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2", *GRACE],
                            log_dir=proc_log_dir, name="stopped_sidecar")
    sidecar.start()
    try:
        body = {"text": "go on", "stream": True,
                "sampling_params": {"max_new_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}}
        clients = start_clients(sidecar.url + "/generate", body, 3, timeout=80)
        for client in clients:
            assert client.started_streaming.wait(20), "the stream never started"
        armed = drill.with_suffix(".tmp")
        armed.write_text(json.dumps({"kind": "stall", "at": "decode", "delay_s": STALL_S}))
        armed.replace(drill)  # whole, never read half written
        wait_until(lambda: drill.with_name(drill.name + ".fired").exists(), timeout=20, what="the engine stalled")
        stopped = time.monotonic()
        engine.terminate()
        sidecar.terminate()  # as the kubelet signals every container of the pod
        wait_until(lambda: _refused(sidecar.url), timeout=10, what="new connections refused")
        for client in clients:
            result = client.finish(timeout=80)
            assert result.status == 200 and result.saw_done, result
            assert result.finish_reason == "length" and result.events[-1]["meta_info"]["completion_tokens"] == NUM_TOKENS
        assert time.monotonic() - stopped > 5  # past uvicorn's default grace, which cut these streams before
        for proc in (sidecar, engine):  # each exits by itself once its streams are done
            wait_until(lambda: not proc.is_running(), timeout=30, what=f"{proc.name} to exit")
            assert "Finished server process" in proc.log_tail(), proc.log_tail()  # (uvicorn re-raises SIGTERM)
    finally:
        sidecar.stop()
        engine.stop()


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.parametrize("module", [["lb"], ["node_sidecar", "--engine-url", "http://127.0.0.1:1"]])
def test_an_address_that_cannot_be_had_exits_2_naming_it(module: list[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", *module, "--host", "127.0.0.1", "--port", str(port)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr[-500:]
    done = subprocess.run([sys.executable, "-m", *module, "--port", "70000"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "a port is a number in 0-65535" in done.stderr

"""A control call the sidecar answers with an error leaves a line in its log: the caller's answer was the only
trace of a release refused, a resume that found no engine, a reload that failed."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def node(proc_log_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """An engine without ``--enable-memory-saver`` (a release is refused 409) and its sidecar, with a token."""
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=proc_log_dir,
                           name="control-log-engine").start()
    sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--engine-poll-interval", "0.2",
                                             "--admin-token", "t0ken"],
                            log_dir=proc_log_dir, name="control-log-sidecar").start()
    try:
        wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=20, what="serving")
        yield engine, sidecar
    finally:
        sidecar.stop()
        engine.stop()


def warnings_of(sidecar: ServerProcess) -> list[str]:
    return [line for line in sidecar.log_path.read_text().splitlines() if " WARNING " in line]


def test_a_failed_control_call_is_logged_with_its_path_status_and_reason(
        node: tuple[ServerProcess, ServerProcess]) -> None:
    engine, sidecar = node
    admin = {"authorization": "Bearer t0ken"}
    with httpx.Client(base_url=sidecar.url, timeout=30) as http:
        before = warnings_of(sidecar)
        assert http.post("/release_memory_occupation", json={}).status_code == 401  # a stranger: no line
        assert http.get("/release_memory_occupation").status_code == 405
        refused = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}, headers=admin)
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "memory_saver_disabled"
        wait_until(lambda: len(warnings_of(sidecar)) > len(before), timeout=10, what="a line")
        lines = warnings_of(sidecar)[len(before):]
        assert len(lines) == 1, lines
        assert "POST /release_memory_occupation failed" in lines[0]
        assert "409 memory_saver_disabled: " in lines[0] and refused.json()["error"]["message"] in lines[0]
        engine.kill()
        wait_until(lambda: http.get("/memory_occupation").json()["engine_reachable"] is False, timeout=10,
                   what="the engine seen down")
        before = warnings_of(sidecar)
        gone = http.post("/resume_memory_occupation", json={}, headers=admin)
        assert gone.status_code == 503 and gone.json()["error"]["type"] == "engine_unavailable"
        wait_until(lambda: any("POST /resume_memory_occupation failed" in line and "503 engine_unavailable" in line
                               for line in warnings_of(sidecar)[len(before):]), timeout=10, what="the line")

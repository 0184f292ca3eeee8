"""The version a request reports is the one its tokens were made under, as SGLang 0.5.23 reports it.

SGLang's ``/update_weight_version`` (``http_server.py:1527-1540``) aborts every request first
(``abort_all_requests``, true by default), then changes the version. The scheduler answers the aborts before it
takes the new version, and the tokenizer reads its version for an aborted request
(``tokenizer_manager.py:3603-3606``) before it records the new one (``tokenizer_control_mixin.py:1065-1069``),
so an aborted rollout reports the version it ran under, never the one that ended it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support.procs import ServerProcess

NUM_STREAMS = 3


@pytest.fixture(scope="module")
def engine(proc_log_dir: Path) -> Iterator[str]:
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--weight-version", "v-old"],
                         log_dir=proc_log_dir, name="versioned")
    proc.start()
    yield proc.url
    proc.stop()


BODIES = {"/generate": lambda i: {"text": f"prompt {i}", "stream": True,
                                  "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}},
          "/v1/completions": lambda i: {"model": "m", "prompt": f"prompt {i}", "stream": True, "max_tokens": 2000,
                                        "ignore_eos": True}}


def _version(event: dict[str, Any]) -> str:
    return event["meta_info"]["weight_version"] if "meta_info" in event else event["metadata"]["weight_version"]


@pytest.mark.parametrize("path", list(BODIES))
def test_requests_aborted_by_a_version_update_report_the_version_they_ran_under(engine: str, path: str) -> None:
    old = httpx.get(engine + "/get_weight_version", timeout=30).json()["weight_version"]
    new = f"{old}-next"
    started = [threading.Event() for _ in range(NUM_STREAMS)]
    finals: list[dict[str, Any] | None] = [None] * NUM_STREAMS

    def stream(index: int) -> None:
        with httpx.stream("POST", engine + path, json=BODIES[path](index), timeout=60) as response:
            if response.status_code != 200:
                started[index].set()
                return
            for line in response.iter_lines():
                if not line.startswith("data:") or "[DONE]" in line:
                    continue
                started[index].set()
                finals[index] = json.loads(line.removeprefix("data:"))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    try:
        for event in started:
            assert event.wait(timeout=60), "a stream never started"
        # every request stays in the engine, not stepping, until the version update aborts it
        paused = httpx.post(engine + "/pause_generation", json={"mode": "retract"}, timeout=30)
        assert paused.status_code == 200, paused.text
        updated = httpx.post(engine + "/update_weight_version", json={"new_version": new}, timeout=30)
        assert updated.status_code == 200, updated.text
        assert updated.json() == {"success": True, "message": f"Weight version updated to {new}",
                                  "new_version": new}
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a stream was not ended by the version update's abort"
    finally:
        httpx.post(engine + "/continue_generation", json={}, timeout=30)
    for final in finals:
        assert final is not None
        if path == "/generate":
            assert final["meta_info"]["finish_reason"]["type"] == "abort"
        assert _version(final) == old, final
    # what runs after the update runs under the new version
    after = httpx.post(engine + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                       timeout=30)
    assert after.json()["meta_info"]["weight_version"] == new

"""``handoff demo`` failing: one line that points at logs that are still there, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from handoff import demo
from handoff.cluster.process import ProcessFailed


class ClusterThatCannotStart:
    """Fault injection: a local cluster whose start fails as a real one does when an engine exits."""

    def __init__(self, spec: object, logs: Path, *, die_with_parent: bool = False) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "node0-engine.log").write_text("the engine's last words\n")

    def start(self) -> None:
        raise ProcessFailed("node0-engine exited with code 1")

    def stop(self) -> None:
        pass


def test_a_demo_that_cannot_start_says_so_and_keeps_its_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logs lived in the demo's temporary folder, deleted before the user could read the path printed; a
    start failure was a traceback (found by review)."""
    monkeypatch.setattr(demo, "LocalCluster", ClusterThatCannotStart)
    said: list[str] = []
    assert demo.run_demo(1, say=said.append) == 1
    failure = said[-1]
    assert "DEMO FAILED: node0-engine exited with code 1" in failure
    logs = Path(failure.rsplit("(logs: ", 1)[1].rstrip(")"))
    assert (logs / "node0-engine.log").read_text() == "the engine's last words\n"

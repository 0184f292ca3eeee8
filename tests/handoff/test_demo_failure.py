"""``handoff demo`` failing: one line that points at logs that are still there, never a traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from handoff import demo
from handoff.cluster.process import ServerProcess

pytestmark = pytest.mark.timeout(60)

# Fault injection: the engine process writes its last words and exits 1, as one that cannot load its model does.
DYING_ENGINE = [sys.executable, "-c", "import sys; print(\"the engine's last words\"); sys.exit(1)", "--"]


def test_a_demo_that_cannot_start_says_so_and_keeps_its_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logs lived in the demo's temporary folder, deleted before the user could read the path printed; a
    start failure was a traceback (found by review)."""
    launch = ServerProcess.launch

    def dying_engine(self: ServerProcess, **kwargs: object) -> ServerProcess:
        if self.module == "node_engine":
            self.wrapper = DYING_ENGINE  # the real command follows, never run
        return launch(self, **kwargs)

    monkeypatch.setattr(ServerProcess, "launch", dying_engine)
    said: list[str] = []
    assert demo.run_demo(1, say=said.append) == 1
    failure = said[-1]
    assert failure.startswith("\nDEMO FAILED: node0-engine exited with 1\n"), failure
    logs = Path(failure.rsplit("(logs: ", 1)[1].rstrip(")"))
    try:
        assert "the engine's last words\n" in (logs / "node0-engine.log").read_text()
    finally:
        shutil.rmtree(logs, ignore_errors=True)

"""The tests start services the way ``handoff up`` does: with the product's own launcher."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from handoff.cluster import process
from handoff.cluster.process import ProcessFailed, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ProcessFailed", "ServerProcess", "wait_until", "REPO_ROOT"]


class ServerProcess(process.ServerProcess):
    """Runs from the repository root, so test-only modules (``tests.support.*``) can be started too."""

    def __init__(self, module: str, args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("cwd", REPO_ROOT)
        super().__init__(module, args, **kwargs)

    def launch(self, *args: Any, **kwargs: Any) -> "ServerProcess":
        # A test run killed outright (a timeout's SIGKILL) leaves no service behind. Linux signals the death of
        # the *thread* that started the child, so only the main thread's children (the fixtures') get it.
        self.die_with_parent = threading.current_thread() is threading.main_thread()
        return super().launch(*args, **kwargs)

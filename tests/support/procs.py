"""The tests start services the way ``handoff up`` does: with the product's own launcher."""

from __future__ import annotations

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

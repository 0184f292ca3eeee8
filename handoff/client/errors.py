"""What the client returns and raises: per-node results, typed errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handoff.protocol import errors as E

class HandoffError(Exception):
    """A call answered with an error: ``status``, ``type`` and ``message`` from the envelope."""

    def __init__(self, status: int, type: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.body = body


class ServiceUnavailable(HandoffError):
    """503: nothing can serve now; ``retry_after`` seconds is the server's hint."""

    def __init__(self, status: int, type: str, message: str, body: Any, retry_after: float | None) -> None:
        super().__init__(status, type, message, body)
        self.retry_after = retry_after


@dataclass(frozen=True)
class NodeResult:
    node: str
    role: str
    status: int | None
    body: Any = None


class FanoutFailed(HandoffError):
    """502: a control call failed on some nodes. Nodes are idempotent: retrying the whole call is safe."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(E.FANOUT_FAILED.status, E.FANOUT_FAILED.name, str(body.get("message", "control call failed on some nodes")), body)
        self.total: int = int(body.get("total", 0))
        self.failed: int = int(body.get("failed", 0))
        self.failures: list[dict[str, Any]] = list(body.get("failures", []))
        self.succeeded: list[NodeResult] = [_node_result(r) for r in body.get("succeeded", [])]

    @property
    def failed_nodes(self) -> list[str]:
        return [f["node"] for f in self.failures]


@dataclass(frozen=True)
class FanoutResult:
    """A control call that succeeded on every node."""

    total: int
    results: tuple[NodeResult, ...]

    def bodies(self) -> dict[str, Any]:
        return {r.node: r.body for r in self.results}


def _node_result(item: dict[str, Any]) -> NodeResult:
    return NodeResult(node=item.get("node", ""), role=item.get("role", ""), status=item.get("status"),
                      body=item.get("body"))

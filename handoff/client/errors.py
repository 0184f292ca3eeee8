"""What the client returns and raises: per-node results, typed errors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from handoff.protocol import errors as E

class HandoffError(Exception):
    """A call answered with an error: ``status``, ``type`` and ``message`` from the envelope. ``status`` 0: no
    answer came whole (``unreachable``, ``timeout``, ``incomplete_response``, ``incomplete_stream``)."""

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
        """The message names the failed nodes and why (the first :data:`MAX_NODES_NAMED`): a traceback in a
        training log says which nodes to look at."""
        failures = _dicts(body.get("failures"))
        message = str(body.get("message", "control call failed on some nodes"))[:500]
        if failures:
            named = "; ".join(_failure_text(f) for f in failures[:MAX_NODES_NAMED])
            more = len(failures) - MAX_NODES_NAMED
            message += f": {named}" + (f" (and {more} more)" if more > 0 else "")
        super().__init__(E.FANOUT_FAILED.status, E.FANOUT_FAILED.name, message, body)
        self.total: int = _int(body.get("total"))
        self.failed: int = _int(body.get("failed"))
        self.failures: list[dict[str, Any]] = failures
        self.succeeded: list[NodeResult] = [node_result(r) for r in _dicts(body.get("succeeded"))]

    @property
    def failed_nodes(self) -> list[str]:
        return [str(f.get("node", "")) for f in self.failures]


@dataclass(frozen=True)
class FanoutResult:
    """A control call that succeeded on every node (one, when the client talks to a sidecar)."""

    total: int
    results: tuple[NodeResult, ...]

    def bodies(self) -> dict[str, Any]:
        return {r.node: r.body for r in self.results}


def node_result(item: dict[str, Any]) -> NodeResult:
    status = item.get("status")
    return NodeResult(node=str(item.get("node", "")), role=str(item.get("role", "")),
                      status=status if isinstance(status, int) else None, body=item.get("body"))


MAX_NODES_NAMED = 10


def _failure_text(failure: dict[str, Any]) -> str:
    """``http://node:8000 (409 requests_in_flight)``: one failed node and why, within a bounded length."""
    return f"{str(failure.get('node', '?'))[:200]} ({failure_cause(failure)})"


MAX_DETAIL_PARSED = 4096  # a node's error body, as the LB relays it: parsed for its type only when this short


def failure_cause(failure: dict[str, Any]) -> str:
    """Why one node of a 502 failed, in a few words: the node's status and error type (``503
    engine_unavailable``), a 2xx with the LB's reason and what was wrong (``200 success_false: <the node's
    message>``), or the LB's reason (``connect_failed``, ``timeout: ...``)."""
    reason = str(failure.get("reason") or "failed")[:60]
    status = failure.get("status")
    error = failure.get("error")
    if isinstance(status, int) and not isinstance(status, bool):
        if not 200 <= status < 300:
            return f"{status} {_error_type(failure.get('detail'))}".strip()
        said = error if error else _detail_field(failure.get("detail"), "message")  # the LB found a 2xx failed
        return f"{status} {reason}" + (f": {str(said)[:200]}" if isinstance(said, str) and said else "")
    return f"{reason}: {str(error)[:200]}" if error else reason


def _error_type(detail: Any) -> str:
    """The ``error.type`` of a node's JSON error body, or ``""``."""
    error = _detail_field(detail, "error")
    kind = error.get("type") if isinstance(error, dict) else None
    return kind[:60] if isinstance(kind, str) else ""


def _detail_field(detail: Any, key: str) -> Any:
    """``key`` of a node's JSON body as the LB relays it (``detail``, capped), or None."""
    if not isinstance(detail, str) or len(detail) > MAX_DETAIL_PARSED:
        return None
    try:
        return json.loads(detail).get(key)
    except (ValueError, AttributeError, RecursionError):
        return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _dicts(value: Any) -> list[dict[str, Any]]:
    """The dict items of a peer's list (anything else in it is dropped, never a crash)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []

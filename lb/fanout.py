"""Control fan-out: one call sent to every node at once, one result per node (SPEC section 4).

Each node gets the same body, byte for byte, and at most ``timeout`` seconds
for everything. A node fails when it is unreachable, times out, drops the
connection, answers a non-2xx status, or answers 2xx with JSON
``"success": false``; a failing body is read at most 512 bytes. Nothing is
retried: nodes are idempotent and the caller may repeat the whole call.

While a release or pause is under way its nodes take no new generation
(:meth:`Node.fence`); after a call that may change whether a node serves, each
node that answered (2xx or not) is checked at once, so the answer means the LB
already routes by the new state; nodes that did not answer (unreachable, hung,
dropped) are checked in the background, so they cost their timeout and no more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

from handoff.protocol import errors as E
from handoff.service.upstream import (
    ConnectFailed,
    ConnectionDropped,
    ProtocolError,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeout,
)
from lb.config import Role
from lb.errors import NoNodes
from lb.health import HealthMonitor
from lb.membership import Membership, Node
from lb.metrics import LBMetrics

log = logging.getLogger(__name__)

CONTROL_ROUTES: dict[str, tuple[str, ...]] = {
    "/release_memory_occupation": ("POST",),
    "/resume_memory_occupation": ("POST",),
    "/flush_cache": ("GET", "POST"),
    "/update_weights_from_disk": ("POST",),
    "/pause_generation": ("POST",),
    "/continue_generation": ("POST",),
}
FENCING_PATHS = frozenset({"/release_memory_occupation", "/pause_generation"})
STATE_CHANGING_PATHS = frozenset(CONTROL_ROUTES) - {"/flush_cache"}
MAX_FAILURE_DETAIL_BYTES = 512
MAX_RESULT_BODY_BYTES = 64 * 1024

_REASONS: tuple[tuple[type[UpstreamError], str], ...] = (
    (ConnectFailed, "unreachable"),
    (UpstreamTimeout, "timeout"),
    (ConnectionDropped, "dropped"),
    (ProtocolError, "protocol_error"),
)


@dataclass
class NodeResult:
    """What one node did with the call. ``reason`` is None on success."""

    node: Node
    status: int | None = None
    body: Any = None
    reason: str | None = None
    error: str | None = None
    detail: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.reason is None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node.url, "role": self.node.role.value}
        if self.is_ok:
            out.update(status=self.status, body=self.body)
            return out
        out["reason"] = self.reason
        for key in ("status", "detail", "error"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class FanOut:
    def __init__(self, client: UpstreamClient, membership: Membership, health: HealthMonitor,
                 metrics: LBMetrics, node_headers: Mapping[str, str]) -> None:
        self._client = client
        self._membership = membership
        self._health = health
        self._metrics = metrics
        self._node_headers = dict(node_headers)
        self._background: set[asyncio.Task[None]] = set()

    async def run(self, method: str, path: str, body: bytes, content_type: str | None, role: Role | None,
                  timeout_s: float) -> tuple[int, dict[str, Any]]:
        """Send the call to every node (of ``role``); (HTTP status, SPEC 4 body)."""
        nodes = list(self._membership.nodes(role))
        if not nodes:
            raise NoNodes(f"no {role.value + ' ' if role else ''}nodes to send {path} to")
        headers = dict(self._node_headers)
        if content_type:
            headers["Content-Type"] = content_type
        is_fencing = path in FENCING_PATHS
        if is_fencing:
            for node in nodes:
                node.fence()
        started = time.perf_counter()
        results = await asyncio.gather(*(self._call_and_settle(node, method, path, body, headers, timeout_s,
                                                               is_fencing) for node in nodes))
        duration_s = time.perf_counter() - started
        self._metrics.fanout_seconds.labels(path=path).observe(duration_s)
        return self._answer(method, path, results, duration_s)

    async def _call_and_settle(self, node: Node, method: str, path: str, body: bytes,
                               headers: Mapping[str, str], timeout_s: float, is_fencing: bool) -> NodeResult:
        try:
            result = await self._call(node, method, path, body, headers, timeout_s)
        except BaseException:
            if is_fencing:
                node.unfence()
            raise
        if result.status is not None and path in STATE_CHANGING_PATHS:  # it answered: checking is quick
            try:
                await self._health.check(node)
            finally:
                if is_fencing:
                    node.unfence()
        elif is_fencing or path in STATE_CHANGING_PATHS:
            task = asyncio.ensure_future(self._settle_later(node, is_fencing))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return result

    async def _settle_later(self, node: Node, is_fencing: bool) -> None:
        try:
            await self._health.check(node)
        finally:
            if is_fencing:
                node.unfence()

    async def _call(self, node: Node, method: str, path: str, body: bytes, headers: Mapping[str, str],
                    timeout_s: float) -> NodeResult:
        try:
            response = await self._client.request(method, node.url + path, headers=headers, body=body,
                                                  timeout=timeout_s)
            if not 200 <= response.status < 300:
                raw = await response.read(MAX_FAILURE_DETAIL_BYTES)
                return NodeResult(node, status=response.status, reason="http_status", detail=_capped_text(raw))
            raw = await response.read(MAX_RESULT_BODY_BYTES)
        except UpstreamError as exc:
            reason = next((name for cls, name in _REASONS if isinstance(exc, cls)), "error")
            error = f"no complete answer within {timeout_s:g} s" if reason == "timeout" else str(exc)
            return NodeResult(node, reason=reason, error=error)
        return _judge_success(node, response.status, raw, response.is_truncated)

    def _answer(self, method: str, path: str, results: list[NodeResult],
                duration_s: float) -> tuple[int, dict[str, Any]]:
        failures = [result for result in results if not result.is_ok]
        total = len(results)
        if not failures:
            log.info("%s %s: ok on %d node(s) in %.3f s", method, path, total, duration_s)
            return 200, {"success": True, "total": total, "results": [r.as_json() for r in results]}
        for result in failures:
            self._metrics.fanout_node_failures.labels(path=path, reason=result.reason).inc()
        message = f"{path} failed on {len(failures)}/{total} nodes"
        log.warning("%s %s in %.3f s: %s", method, message, duration_s,
                    "; ".join(f"{r.node.url} {r.reason}: {r.error or r.status}" for r in failures[:10]))
        return 502, {
            "success": False,
            "message": message,
            "total": total,
            "failed": len(failures),
            "failures": [r.as_json() for r in failures],
            "succeeded": [r.as_json() for r in results if r.is_ok],
            "error": {"type": E.FANOUT_FAILED.name, "message": message},
        }


def _capped_text(raw: bytes) -> str:
    return raw[:MAX_FAILURE_DETAIL_BYTES].decode("utf-8", "replace")


def _judge_success(node: Node, status: int, raw: bytes, is_truncated: bool) -> NodeResult:
    """A 2xx answer: JSON ``"success": false`` makes it a failure; the body is kept as JSON or text."""
    if is_truncated:
        return NodeResult(node, status=status, body=_capped_text(raw))
    try:
        body = json.loads(raw) if raw.strip() else None
    except (UnicodeDecodeError, ValueError):
        return NodeResult(node, status=status, body=_capped_text(raw))
    if isinstance(body, dict) and body.get("success") is False:
        return NodeResult(node, status=status, reason="success_false", detail=_capped_text(raw))
    return NodeResult(node, status=status, body=body)

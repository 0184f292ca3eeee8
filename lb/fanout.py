"""Control fan-out: one call sent to every node at once, one result per node (SPEC section 4).

Each node gets the same body, byte for byte, and at most ``timeout`` seconds
for everything; the whole answer, any follow-up included, is in within that
time. A node fails when it is unreachable, times out, drops the connection,
answers a non-2xx status, answers 2xx with JSON ``"success": false``, or
answers something that cannot be judged (a 2xx body over the result cap, or a
JSON answer that does not parse within bounds); a failing body is read at most
512 bytes. Nothing is retried: nodes are idempotent and the caller may repeat
the whole call.

One request per node: a sidecar answers every control call with its state in
:data:`~handoff.protocol.control.NODE_STATE_HEADER`, which the LB adopts as a
health check, so the answer means the LB already routes by the node's new
state. A node without that header (a plain server) is checked once more within
what is left of the deadline, after a call that may change whether it serves or
the weight version it serves (:data:`RECHECKED_PATHS`). While a release or pause
is under way its nodes take no new generation (a :class:`~lb.node.Fence`); a
node that did not answer stays fenced until a check in the background has seen
it.

Every node's request is written in one pass, and one coroutine reads the
answers in the order they complete: no task per node (the most a large
fan-out cost the LB), and a node answering late, or never, delays no other
node's verdict.

A body with a ``drain_timeout`` the per-node deadline cannot cover is refused
(400, naming both); the deadline also goes to the node in
:data:`~handoff.protocol.control.DEADLINE_HEADER`, so a sidecar ends a drain in
time to answer instead of being reported timed out while it drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Mapping

from handoff.protocol import errors as E
from handoff.protocol.control import (
    DEADLINE_HEADER,
    DRAINING_PATHS,
    FENCING_PATHS,
    STATE_CHANGING_PATHS,
)
from handoff.service.errors import InvalidRequest
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import PendingRequest, UpstreamClient, UpstreamError
from lb.config import Role
from lb.errors import NoNodes
from lb.fanout_answers import Arrivals, answer_of
from lb.health import HealthMonitor
from lb.membership import Membership
from lb.metrics import LBMetrics
from lb.node import Fence, Node
from lb.node_answer import MAX_FAILURE_DETAIL_BYTES, NodeResult, ParsedAnswers, result_cap

log = logging.getLogger(__name__)

__all__ = ["FanOut", "NodeResult", "check_drain_fits", "default_deadline"]

DRAIN_MARGIN_S = 10.0  # past a drain_timeout, for the release itself and the answer's way back


def answer_caps(path: str) -> tuple[int, int]:
    """What a node's answer to ``path`` is read to: a 2xx, any other."""
    return result_cap(path), MAX_FAILURE_DETAIL_BYTES


# the calls after which a node's state is known before the answer: those that may change whether it serves, and the
# weight calls that change the version it serves (a pinned request is routed by it)
RECHECKED_PATHS = STATE_CHANGING_PATHS | {"/update_weights_from_distributed", "/update_weights_from_tensor",
                                          "/update_weight_version"}

def drain_of(path: str, body: bytes) -> float | None:
    """The ``drain_timeout`` of a draining call's body (None: none, or not a number the LB can judge: bodies
    that are not JSON objects go on, and the node refuses them itself)."""
    if path not in DRAINING_PATHS or (b"drain_timeout" not in body and b"\\u" not in body):
        return None  # (a key may be written with escapes: "drain\u005ftimeout")
    try:
        payload = loads_bounded(body)
    except PeerJSONError:
        return None
    drain = payload.get("drain_timeout") if isinstance(payload, dict) else None
    if isinstance(drain, bool) or not isinstance(drain, (int, float)):
        return None
    try:
        return float(drain)
    except OverflowError:
        return None  # an integer no float holds: the node refuses it itself


def default_deadline(path: str, body: bytes, default_s: float, max_s: float) -> float:
    """The per-node deadline of a call without ``?timeout=``: ``default_s`` (``--control-timeout``), raised to
    cover the body's ``drain_timeout`` plus :data:`DRAIN_MARGIN_S` (at most ``max_s``). Never below the default:
    a client that sent ``drain_timeout: 0`` for a release that takes long (weights staged to host memory) must
    not have its node reported timed out while it still releases."""
    drain = drain_of(path, body)
    if drain is None or not drain + DRAIN_MARGIN_S > default_s:  # (nan: the node refuses it)
        return default_s
    return min(drain + DRAIN_MARGIN_S, max_s)


def check_drain_fits(path: str, body: bytes, timeout_s: float) -> None:
    """400 for a ``drain_timeout`` the per-node deadline cannot cover (the node would be reported timed out
    while it still drains)."""
    drain = drain_of(path, body)
    if drain is not None and drain >= timeout_s:
        raise InvalidRequest(f"drain_timeout ({drain:g} s) must be shorter than the per-node timeout "
                             f"({timeout_s:g} s, from ?timeout= or --control-timeout): a node still draining "
                             "when the LB stops waiting would be reported as timed out",
                             extra={"drain_timeout": drain, "timeout": timeout_s})


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
                  timeout_s: float, nodes: list[Node] | None = None) -> tuple[int, dict[str, Any]]:
        """Send the call to every node (of ``role``), or to ``nodes``; (HTTP status, SPEC 4 body). The checks
        some nodes need run together once every answer is in."""
        nodes = list(self._membership.nodes(role) if nodes is None else nodes)
        if not nodes:
            raise NoNodes(f"no {role.value + ' ' if role else ''}nodes to send {path} to")
        check_drain_fits(path, body, timeout_s)
        headers = self._headers(timeout_s, content_type)
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        results: list[NodeResult | None] = [None] * len(nodes)
        checks: dict[asyncio.Future[None], Fence | None] = {}
        fences = [node.fence() if path in FENCING_PATHS else None for node in nodes]
        try:
            sent = self._client.start_many(method, [node.url + path for node in nodes], headers=headers,
                                           body=body, timeout=timeout_s, answer_caps=answer_caps(path))
            try:
                await self._read_answers(nodes, fences, sent, path, timeout_s, results, checks)
                if checks:
                    await asyncio.wait(checks, timeout=max(0.0, deadline - loop.time()))
            finally:
                self._abandon([request for request, result in zip(sent, results) if result is None], checks)
        finally:  # whatever ends the call, every fence is lifted that no check in the background took over
            for fence in fences:  # (hand_over); one loop, not an exit stack of 128 contexts on every release
                if fence is not None:
                    fence.lift()
        duration_s = time.perf_counter() - started
        self._metrics.fanout_seconds.labels(path=path).observe(duration_s)
        return self.answer(method, path, [result for result in results if result is not None], duration_s)

    async def _read_answers(self, nodes: list[Node], fences: list[Fence | None],
                            sent: list[PendingRequest | UpstreamError], path: str, timeout_s: float,
                            results: list[NodeResult | None], checks: dict[asyncio.Future[None], Fence | None]) -> None:
        """Each node's answer into ``results`` (in node order), read in the order they come in (reading one
        waits for no peer: see :mod:`handoff.service.upstream_pending`); a check a node needs goes into
        ``checks``."""
        parsed = ParsedAnswers()
        arrivals = Arrivals(sent)
        for _ in nodes:
            index = await arrivals.next()
            result, state = await answer_of(nodes[index], sent[index], timeout_s, parsed, result_cap(path))
            results[index] = result
            check = self._settle(nodes[index], fences[index], path, result, state)
            if check is not None:
                checks[check] = fences[index]

    async def call_node(self, node: Node, method: str, path: str, body: bytes, content_type: str | None,
                        timeout_s: float) -> NodeResult:
        """One node's call under the fan-out's rules (deadline header, answer judged, the state it carries
        adopted, or the node checked within the deadline as in :meth:`run`), for calls that send each node its
        own body or go to some nodes only."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        request = self._send(node, method, path, body, self._headers(timeout_s, content_type), timeout_s)
        result, state = await answer_of(node, request, timeout_s, ParsedAnswers(), result_cap(path))
        check = self._settle(node, None, path, result, state)
        if check is not None:
            await asyncio.wait({check}, timeout=max(0.0, deadline - loop.time()))
            if not check.done():
                self._finish_in_background(check, None)
        return result

    def _headers(self, timeout_s: float, content_type: str | None) -> dict[str, str]:
        headers = {**self._node_headers, DEADLINE_HEADER: f"{timeout_s:g}"}
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _send(self, node: Node, method: str, path: str, body: bytes, headers: Mapping[str, str],
              timeout_s: float) -> PendingRequest | UpstreamError:
        """The node's request, written now (or connecting); the error when it cannot even be sent."""
        try:
            return self._client.start(method, node.url + path, headers=headers, body=body, timeout=timeout_s,
                                      answer_caps=answer_caps(path))
        except UpstreamError as exc:
            return exc

    def _settle(self, node: Node, fence: Fence | None, path: str, result: NodeResult,
                state: dict[str, Any] | None) -> asyncio.Future[None] | None:
        """The node's state after its answer: adopted from the answer (fence lifted), or a check to wait for
        within the deadline (returned), or, for a node that did not answer, a check in the background that the
        fence waits for."""
        if state is not None:
            self._health.apply_state(node, state)
        elif result.status is not None and path in RECHECKED_PATHS:
            return asyncio.ensure_future(self._health.check(node))
        elif fence is not None or path in RECHECKED_PATHS:
            self._finish_in_background(asyncio.ensure_future(self._health.check(node)),
                                       None if fence is None else fence.hand_over())
            return None
        if fence is not None:
            fence.lift()
        return None

    def _abandon(self, unread: list[PendingRequest | UpstreamError],
                 checks: dict[asyncio.Future[None], Fence | None]) -> None:
        """What a fan-out leaves when it ends (or is cancelled): requests whose answer was never read (left by a
        cancellation) closed; checks not done go on in the background, each holding its node's fence (the others
        are lifted as the fan-out's block exits)."""
        for request in unread:
            if isinstance(request, PendingRequest):
                request.close()
        for check, fence in checks.items():
            if not check.done():
                self._finish_in_background(check, None if fence is None else fence.hand_over())

    def _finish_in_background(self, check: asyncio.Future[None], fence: Fence | None) -> None:
        """Wait for ``check`` in the background, holding ``fence`` (lifted when the check ends, however)."""
        async def settle() -> None:
            with fence or contextlib.nullcontext():
                await check

        task = asyncio.ensure_future(settle())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def answer(self, method: str, path: str, results: list[NodeResult],
               duration_s: float) -> tuple[int, dict[str, Any]]:
        """200 with one result per node, or 502 naming every node that failed (SPEC section 4)."""
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

"""Relaying one generation request to a node and its answer back, byte for byte.

- ``DisconnectWatch`` (from ``handoff.service.disconnect``) cancels the task
  serving a request when the client goes away, which closes the upstream
  connections it holds: the node sees the disconnect and aborts the request.
- :class:`NodeCaller` sends the request to one node and sorts the outcome:
  a response to relay, a final answer, or "try another node" (the connection
  was refused or could not be made in time, or a sidecar's admission refused
  it with a 503 of :data:`handoff.protocol.errors.NOT_SERVING_TYPES` or with
  503 ``overloaded``: in every case the node ran nothing). A not-serving 503
  takes the node out of rotation until its next health check, except
  ``weight_version_unavailable``: a client's pin to a version the node does not
  serve says nothing of the node; nor does ``overloaded`` (a full budget of
  bodies or connections is momentary). The dispatch loops count a reroute
  (:meth:`NodeCaller.count_retry`) only once another node was picked for it.
- :func:`relay_stream` streams the node's body to the client chunk by chunk
  as it arrives (:class:`handoff.service.relay.StreamRelay`, shared with the
  sidecar); a node failing mid-stream ends it with an SSE error event.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from prometheus_client import Counter
from starlette.responses import Response

from handoff.protocol import errors as E
from handoff.protocol.errors import NOT_SERVING_TYPES
from handoff.protocol.weights import WEIGHT_VERSION_HEADER
from handoff.service.disconnect import CLIENT_CLOSED, DisconnectWatch
from handoff.service.errors import Unavailable
from handoff.service.logs import rate_limit
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.relay import ChunkTransform, StreamRelay, WholeAnswer, relayed_headers, sse_error_event
from handoff.service.upstream import (
    ConnectFailed,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from lb.answer_budget import count_answer
from lb.errors import UpstreamFailed, UpstreamTimedOut
from lb.health import HealthMonitor
from lb.metrics import LBMetrics
from lb.node import Node, RequestLease

log = logging.getLogger(__name__)
rate_limit(log)  # a node failing every stream is a warning per request

REQUEST_HEADERS_TO_NODE = frozenset({b"content-type", b"accept", b"x-request-id", WEIGHT_VERSION_HEADER.encode()})
MAX_REFUSAL_BYTES = 4096
MAX_REASON_CHARS = 160  # of a refusing node's message, in the 503 that names every node tried
CLIENT_CLOSED_REQUEST = CLIENT_CLOSED


def client_gone_response() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def headers_to_node(scope_headers: Sequence[tuple[bytes, bytes]], node_headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers a node needs (content type, accept, request id) plus the LB's own token."""
    headers = dict(node_headers)
    for name, value in scope_headers:
        if name in REQUEST_HEADERS_TO_NODE:
            headers[name.decode("latin-1")] = value.decode("latin-1")
    return headers


def buffered_response(upstream: UpstreamResponse, body: bytes) -> Response:
    """The node's answer, read whole, with its status and the headers the client gets; sent in pieces, so its
    bytes stay in the request's answer share until the last went out (a client that stops reading is cut past the
    exchange's deadline, as a stream is)."""
    return WholeAnswer(body, status=upstream.status, deadline=upstream.deadline,
                       headers=[*relayed_headers(upstream), (b"content-length", str(len(body)).encode())])


def is_event_stream(upstream: UpstreamResponse) -> bool:
    return upstream.content_type.startswith("text/event-stream")


def translate(node: Node, path: str, exc: UpstreamError, timeout_s: float) -> UpstreamFailed | UpstreamTimedOut:
    """A node's failure after it may have started the work: 504 on timeout, else 502 (logged)."""
    if isinstance(exc, UpstreamTimeout):
        return logged(UpstreamTimedOut(f"{node.url} did not complete {path} within {timeout_s:g} s",
                                       extra={"node": node.url}))
    return logged(UpstreamFailed(f"{node.url} failed on {path}: {exc}", extra={"node": node.url}))


def logged(error: UpstreamFailed | UpstreamTimedOut) -> UpstreamFailed | UpstreamTimedOut:
    """``error``, written to the log first: a node failing a request after it took it (a dropped connection, a
    timeout, an answer over the cap) is the operator's to see, as a stream cut mid-way is (rate limited)."""
    log.warning("a generation request failed (%d %s): %s", error.status, error.type, error.message)
    return error


class RerouteCause(enum.Enum):
    """Why a node ran nothing: each is counted by a metric of its own once the request went to another node."""

    UNREACHABLE = "unreachable"  # the connection was refused or not made in time
    NOT_SERVING = "not_serving"  # a 503 of NOT_SERVING_TYPES
    OVERLOADED = "overloaded"    # a 503 overloaded: the node holds as many bodies or connections as it may


@dataclass(frozen=True)
class Reroute:
    """The request goes to another node: this one ran nothing (its connection was refused or not made in time,
    or it refused the request with a 503 of NOT_SERVING_TYPES or ``overloaded``). ``reason``: what this node
    said, for this request alone (the 503 when every node refused names it; a node's ``last_error`` is shared
    with other requests and its checks, and a refused pin records none)."""

    reason: str
    cause: RerouteCause


class NodeCaller:
    """Sends one generation request to one node and sorts out what came back."""

    def __init__(self, client: UpstreamClient, health: HealthMonitor, metrics: LBMetrics,
                 timeout_s: float, max_answer_bytes: int) -> None:
        self._client = client
        self._health = health
        self._metrics = metrics
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.streams_cut = metrics.streams_cut  # counted by relay_stream

    async def call(self, node: Node, path: str, body: bytes,
                   headers: Mapping[str, str]) -> UpstreamResponse | Response | Reroute:
        """The node's response (headers in), a final :class:`Response`, or :class:`Reroute`.

        Raises :class:`UpstreamFailed` / :class:`UpstreamTimedOut` when the node
        failed after it may have started the work.
        """
        try:
            upstream = await self._client.request("POST", node.url + path, headers=headers, body=body,
                                                  timeout=self.timeout_s)
        except ConnectFailed as exc:
            self._health.mark_unreachable(node, str(exc))
            return Reroute(str(exc), RerouteCause.UNREACHABLE)
        except UpstreamError as exc:
            node.record_error(str(exc))
            raise translate(node, path, exc, self.timeout_s) from exc
        if upstream.status != 503:
            return upstream
        try:
            raw = await upstream.read(MAX_REFUSAL_BYTES)
        except UpstreamError as exc:
            raise translate(node, path, exc, self.timeout_s) from exc
        if upstream.is_truncated:  # relayed, the cut body would be a broken answer
            raise logged(UpstreamFailed(f"{node.url} answered {path} with a 503 of more than {MAX_REFUSAL_BYTES} "
                                        f"bytes: {raw[:512].decode('utf-8', 'replace')}", extra={"node": node.url}))
        error_type, message = _error_of(raw)
        if error_type in NOT_SERVING_TYPES or error_type == E.OVERLOADED.name:
            said = f"answered 503 {error_type}" + (f": {message[:MAX_REASON_CHARS]}" if message else "")
            if error_type == E.OVERLOADED.name:
                return Reroute(said, RerouteCause.OVERLOADED)
            if error_type != E.WEIGHT_VERSION_UNAVAILABLE.name:  # that one says the request's pin, not the node
                self._health.mark_not_serving(node, f"answered 503 {error_type}", error_type)
            return Reroute(said, RerouteCause.NOT_SERVING)
        return buffered_response(upstream, raw)

    def count_retry(self, reroute: Reroute) -> None:
        """``reroute``'s request went to another node (the last refusal before a 503 is no retry)."""
        counters = {RerouteCause.UNREACHABLE: self._metrics.generate_retries,
                    RerouteCause.NOT_SERVING: self._metrics.generate_not_serving_retries,
                    RerouteCause.OVERLOADED: self._metrics.generate_overloaded_retries}
        counters[reroute.cause].inc()

    async def read_body(self, node: Node, upstream: UpstreamResponse, path: str) -> bytes:
        """The node's whole answer, at most ``max_answer_bytes``; past that, or on a failure midway, a 502/504
        naming the node (the answer is buffered to turn such failures into a status, so it is bounded). Its bytes
        count in the request's share of the answers the LB holds (:mod:`lb.answer_budget`): past that bound the
        answer is dropped, 503 ``overloaded``."""
        try:
            raw = await upstream.read(self.max_answer_bytes, count=count_answer)
        except Unavailable as exc:  # the LB's own bound, not the node's fault
            upstream.close()
            log.warning("a node's answer on %s was dropped: %s", path, exc.message)
            raise
        except UpstreamError as exc:
            node.record_error(str(exc))
            raise translate(node, path, exc, self.timeout_s) from exc
        if upstream.is_truncated:
            message = (f"{node.url} answered {path} with more than {self.max_answer_bytes} bytes "
                       "(--max-answer-bytes); stream it (\"stream\": true) or raise the limit")
            node.record_error(message)
            raise logged(UpstreamFailed(message, extra={"node": node.url}))
        return raw


def _error_of(raw: bytes) -> tuple[str | None, str | None]:
    """The ``error`` envelope's type and message in a node's answer (None for what is not a string)."""
    try:
        answer = loads_bounded(raw)
    except PeerJSONError:
        return None, None
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict):
        return None, None
    error_type, message = error.get("type"), error.get("message")  # a peer's list or object is no type
    return (error_type if isinstance(error_type, str) else None, message if isinstance(message, str) else None)


def relay_stream(upstream: UpstreamResponse, lease: RequestLease, path: str, watch: DisconnectWatch, *,
                 cut: Counter, transform: ChunkTransform | None = None,
                 on_close: Callable[[bool], None] | None = None,
                 cut_for: Callable[[], bytes | None] | None = None, head: bytes = b"") -> StreamRelay:
    """A node's stream relayed to the client; the relay owns the upstream, the node's in-flight lease and the
    watch from here on. A node failing mid-stream ends it with an ``upstream_error`` event naming the node, and
    counts in ``cut``. ``cut_for``: what ends the stream instead when the caller cut the node's connection
    (:meth:`~handoff.service.upstream_response.UpstreamResponse.cut`) for a reason of its own (None: not cut;
    not counted: the node did not fail). ``head``: body bytes the caller already read off ``upstream``, relayed
    first."""
    node = lease.node

    def failed(exc: UpstreamError) -> bytes:
        reason = cut_for() if cut_for is not None else None
        if reason is not None:
            return reason
        cut.inc()
        log.warning("%s failed mid-stream on %s: %s", node.url, path, exc)
        node.record_error(str(exc))
        error = E.UPSTREAM_TIMEOUT if isinstance(exc, UpstreamTimeout) else E.UPSTREAM_ERROR
        return sse_error_event(error.name, f"{node.url} failed after the stream started: {exc}")

    def closed(is_disconnected: bool) -> None:
        lease.release()
        if on_close is not None:
            on_close(is_disconnected)

    return StreamRelay(upstream, on_failure=failed, on_close=closed, watch=watch, transform=transform, head=head)

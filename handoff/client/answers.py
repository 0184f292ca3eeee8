"""What the clients make of an answer: read within a size cap and a deadline, judged, decoded into a result or
one :class:`HandoffError`; transport failures mapped to the same error type.

Rules:

- A non-stream answer is read whole, at most ``max_answer_bytes`` (the LB's own
  cap by default) and within the call's deadline, however the server dribbles
  it; past either: ``invalid_response`` / ``timeout``.
- A 2xx that is not a JSON object within bounds, or a control answer that says
  ``"success": false`` or lists a node that failed (or not one result per node
  it counts), is an error, never an empty success.
- A generation or ``memory_occupation`` 2xx that is a JSON object is the result, whatever it holds (an
  ``"error"`` field too): SGLang and handoff's services answer every error with a non-2xx status. Its shape
  is the call's: ``memory_occupation`` an object; ``generate`` an object for one prompt, a list of objects for
  a batch or ``n`` > 1 (as SGLang answers); anything else (``null``, a string, a list for one prompt) is
  ``invalid_response``, never handed to the caller as a result.
- A control call's answer from the LB lists its nodes; a sidecar's own answer
  (the client pointed at one node) is that one node's result.
- Nothing the server or the network does escapes as another exception type:
  ``unreachable`` (nothing was sent), ``timeout``, ``incomplete_response``
  (the connection ended mid-answer; status 0 for the three), ``invalid_response``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import httpx

from handoff.client.errors import (MAX_NODES_NAMED, FanoutFailed, FanoutResult, HandoffError, NodeResult,
                                   ServiceUnavailable, node_result)
from handoff.service.peer_json import PeerJSONError, loads_bounded

DEFAULT_MAX_ANSWER_BYTES = 256 * 1024 * 1024
MAX_ERROR_ANSWER_BYTES = 8 * 1024 * 1024  # an error answer other than a 502
MAX_ERROR_MESSAGE_CHARS = 2000


def answer_cap(status: int, max_answer_bytes: int) -> int:
    """The most bytes read of an answer with ``status``: an error's is small whatever the success cap, but a 502
    has the success's: a fan-out's 502 lists every node, the succeeded ones with their bodies (64 KiB each at the
    LB), as long as the 200 it stands for."""
    is_whole = 200 <= status < 300 or status == 502
    return max_answer_bytes if is_whole else min(max_answer_bytes, MAX_ERROR_ANSWER_BYTES)


class AnswerReader:
    """Collects an answer's bytes, refusing more than ``max_bytes`` or any chunk after ``deadline``."""

    def __init__(self, max_bytes: int, deadline: float, status: int) -> None:
        """``max_bytes``: a success's cap; an error answer's is :data:`MAX_ERROR_ANSWER_BYTES` at most."""
        self._chunks: list[bytes] = []
        self._num_bytes = 0
        self._max_bytes = answer_cap(status, max_bytes)
        self._deadline = deadline
        self._status = status

    def feed(self, chunk: bytes) -> None:
        self._num_bytes += len(chunk)
        if self._num_bytes > self._max_bytes:
            raise HandoffError(self._status, "invalid_response",
                               f"the answer is longer than the client's cap of {self._max_bytes} bytes")
        if time.monotonic() > self._deadline:
            raise HandoffError(0, "timeout", "the answer did not arrive whole within the call's timeout")
        self._chunks.append(chunk)

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)


def transport_failure(exc: httpx.RequestError, *, is_stream: bool = False) -> HandoffError:
    """The client's error for what the network or the server's framing did (``exc`` is httpx's). httpx's own
    text is left out where it could quote a request header (a token): a protocol error names only its kind."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return HandoffError(0, "unreachable", f"could not connect: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return HandoffError(0, "timeout", f"no answer within the call's timeout: {exc}")
    if isinstance(exc, httpx.DecodingError):  # a Content-Encoding the body does not follow
        return HandoffError(200 if is_stream else 0, "invalid_stream" if is_stream else "invalid_response",
                            f"the answer's content encoding cannot be decoded: {exc}")
    kind = "incomplete_stream" if is_stream else "incomplete_response"
    if isinstance(exc, httpx.LocalProtocolError):
        return HandoffError(0, kind, "the request could not be sent (a header or the URL cannot be written)")
    return HandoffError(0, kind, f"the connection ended mid-answer: {exc}")


def _parse(status: int, raw: bytes) -> Any:
    try:
        return loads_bounded(raw)
    except PeerJSONError as exc:
        raise HandoffError(status, "invalid_response", f"the answer is not JSON: {exc}", raw[:500]) from None


def error_of(status: int, headers: Mapping[str, str], raw: bytes, reason: str = "") -> HandoffError:
    """The error of a non-2xx answer: :class:`FanoutFailed` for a fan-out's 502, :class:`ServiceUnavailable` for
    a 503 (with its ``Retry-After``), else :class:`HandoffError` with the envelope's type."""
    try:
        body: Any = loads_bounded(raw)
    except PeerJSONError:
        body = {"error": {"type": "http_error", "message": raw[:500].decode("utf-8", "replace")}}
    if status == 502 and isinstance(body, dict) and "failures" in body:
        return FanoutFailed(body)
    type_, message = envelope_fields(body.get("error") if isinstance(body, dict) else None, "http_error",
                                     reason or f"HTTP {status}")
    if status == 503:
        return ServiceUnavailable(503, type_, message, body, retry_after_seconds(headers.get("retry-after")))
    return HandoffError(status, type_, message, body)


def envelope_fields(error: Any, default_type: str, default_message: str) -> tuple[str, str]:
    """``(type, message)`` of an error envelope's ``error`` as a peer sent it: an object's string fields (else the
    defaults), a bare string as the message; both bounded."""
    if isinstance(error, dict):
        kind, message = error.get("type"), error.get("message")
    else:
        kind, message = None, error
    kind = kind if isinstance(kind, str) and kind else default_type
    message = message if isinstance(message, str) else default_message
    return kind[:100], message[:MAX_ERROR_MESSAGE_CHARS]


def retry_after_seconds(retry_after: str | None) -> float | None:
    """``Retry-After`` in seconds, however long (the :class:`RetryPolicy`'s ``max_wait_s`` and the call's deadline
    bound any wait: a hint past them raises the 503 at once), or None (an HTTP date, a negative number or anything
    else: the policy's default applies)."""
    try:
        seconds = float(retry_after) if retry_after else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < math.inf else None


def node_list(body: Any) -> list[dict[str, Any]]:
    """``GET /nodes``'s members (``{"nodes": [...]}``, or the list itself): anything else is ``invalid_response``."""
    nodes = body.get("nodes") if isinstance(body, dict) else body
    if not isinstance(nodes, list) or not all(isinstance(node, dict) for node in nodes):
        raise HandoffError(200, "invalid_response", "GET /nodes did not answer a list of nodes", body)
    return nodes


def decode(status: int, headers: Mapping[str, str], raw: bytes, *, shape: str, node: str) -> Any:
    """The result of a whole answer; ``shape``: what the call answers (:data:`SHAPES`); ``node``: the URL
    called (a sidecar's own answer is that node's)."""
    if not 200 <= status < 300:
        raise error_of(status, headers, raw)
    body = _parse(status, raw)
    if shape != "fanout":
        return _shaped(status, body, shape)
    if not isinstance(body, dict):
        raise HandoffError(status, "invalid_response", f"a control answer must be a JSON object, got "
                                                       f"{type(body).__name__}", body)
    if body.get("success") is False:
        raise HandoffError(status, "control_failed", str(body.get("message", "the node says it did not succeed")),
                           body)
    if "results" not in body:  # one node's own answer (a sidecar, or an engine)
        return FanoutResult(total=1, results=(NodeResult(node=node, role=str(body.get("role", "")), status=status,
                                                         body=body),))
    results, total = body.get("results"), body.get("total", 0)
    if (not isinstance(results, list) or not all(isinstance(r, dict) for r in results) or not isinstance(total, int)
            or not results or total != len(results)):
        raise HandoffError(status, "invalid_response", "a fan-out answer's results and total are malformed (a "
                                                       "result per node called, at least one)", body)
    failed = [r for r in results if not _succeeded(r)]
    if failed:
        raise HandoffError(status, "control_failed", f"the answer says success, but {len(failed)} of {total} "
                                                     f"node(s) failed: {_nodes_named(failed)}", body)
    return FanoutResult(total=total, results=tuple(node_result(r) for r in results))


SHAPES = ("json", "object", "object_or_list", "list", "fanout")  # "json": judged by the caller (GET /nodes)


def _shaped(status: int, body: Any, shape: str) -> Any:
    """``body`` when it has ``shape`` (``object_or_list``: a generation whose form the request leaves open),
    else ``invalid_response`` saying what was wanted and what came."""
    is_object = isinstance(body, dict)
    is_list = isinstance(body, list) and bool(body) and all(isinstance(item, dict) for item in body)
    if (shape == "json" or (shape == "object" and is_object) or (shape == "list" and is_list)
            or (shape == "object_or_list" and (is_object or is_list))):
        return body
    wanted = {"object": "a JSON object", "list": "a non-empty list of JSON objects (one per sequence)",
              "object_or_list": "a JSON object or a non-empty list of them"}[shape]
    raise HandoffError(status, "invalid_response", f"the answer must be {wanted}, got {_json_kind(body)}", body)


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)" if value else "an empty list"
    return "an object" if isinstance(value, dict) else "null" if value is None else type(value).__name__


def _succeeded(result: dict[str, Any]) -> bool:
    """Whether one node of a fan-out's results succeeded: a 2xx, no failure ``reason``, no ``"success": false``."""
    status, body = result.get("status"), result.get("body")
    return (type(status) is int and 200 <= status < 300 and "reason" not in result
            and not (isinstance(body, dict) and body.get("success") is False))


def _nodes_named(results: list[dict[str, Any]]) -> str:
    named = ", ".join(str(r.get("node", "?"))[:200] for r in results[:MAX_NODES_NAMED])
    return named + (f" (and {len(results) - MAX_NODES_NAMED} more)" if len(results) > MAX_NODES_NAMED else "")

"""One node's answer to a control call, read and judged (SPEC section 4): :class:`NodeResult`.

A 2xx answer succeeds unless its JSON says ``"success": false`` (or anything
but true, or carries an error object without ``success``) or it cannot be
judged: longer than :data:`MAX_RESULT_BODY_BYTES` (a ``"success": false``
could be past what was read) or JSON that does not parse within bounds. A
failing answer's body is kept to :data:`MAX_FAILURE_DETAIL_BYTES`. What the
nodes of one fan-out answered is parsed once per distinct value
(:class:`ParsedAnswers`), and the fan-out's answer encodes each distinct
body once too (:func:`dumps_answer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from handoff.protocol.control import MAX_NODE_STATE_HEADER_BYTES
from handoff.protocol.weights import WEIGHTS_CHECKER_PATH
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import UpstreamResponse
from lb.node import Node

__all__ = ["MAX_FAILURE_DETAIL_BYTES", "MAX_RESULT_BODY_BYTES", "NodeResult", "ParsedAnswers", "capped_text",
           "dumps_answer", "judge_success", "result_cap", "state_problem"]

MAX_FAILURE_DETAIL_BYTES = 512
MAX_RESULT_BODY_BYTES = 64 * 1024
# SGLang's checksum names every tensor once per TP rank (a 7B model on 8 ranks: ~160 KB); read to the sidecar's
# own cap on an engine's control answer
MAX_CHECKSUM_BODY_BYTES = 4 * 1024 * 1024


def result_cap(path: str) -> int:
    """What a node's 2xx answer to ``path`` is read to."""
    return MAX_CHECKSUM_BODY_BYTES if path == WEIGHTS_CHECKER_PATH else MAX_RESULT_BODY_BYTES


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


def capped_text(raw: bytes) -> str:
    return raw[:MAX_FAILURE_DETAIL_BYTES].decode("utf-8", "replace")


@dataclass(frozen=True)
class _Unreadable:
    error: str


class ParsedAnswers:
    """What one fan-out's nodes answered, parsed once per distinct value: the nodes mostly answer alike (the
    same state, the same body). Nodes that sent the same bytes share the parsed value; nothing mutates it (a
    node's new state replaces the old one, and results are only read and encoded)."""

    def __init__(self) -> None:
        self._states: dict[str, dict[str, Any] | None] = {}
        self._bodies: dict[bytes, Any] = {}

    def state(self, value: str | None) -> dict[str, Any] | None:
        """The state a sidecar put in its answer's header, if it is there and readable."""
        if value is None:
            return None
        if value not in self._states:
            self._states[value] = _parse_state(value)
        return self._states[value]

    def body(self, raw: bytes) -> Any:
        """A 2xx answer's JSON; raises :class:`PeerJSONError` (each time) for one that does not parse in bounds."""
        if raw not in self._bodies:
            try:
                self._bodies[raw] = loads_bounded(raw)
            except PeerJSONError as exc:
                self._bodies[raw] = _Unreadable(str(exc))
        value = self._bodies[raw]
        if isinstance(value, _Unreadable):
            raise PeerJSONError(value.error)
        return value


def _parse_state(value: str) -> dict[str, Any] | None:
    try:
        state = loads_bounded(value.encode("latin-1"), max_bytes=MAX_NODE_STATE_HEADER_BYTES)
    except (PeerJSONError, UnicodeEncodeError):
        return None
    return state if isinstance(state, dict) and state_problem(state) is None else None


def state_problem(state: dict[str, Any]) -> str | None:
    """Why a peer's JSON object is no node's state, or None: a sidecar's says whether it serves (``serving``, true
    or false), an engine answered directly lists its ``tags``. Anything else (``{}``, an error body, ``"serving":
    "false"``) tells nothing a node could be routed by."""
    if "serving" in state:
        return None if isinstance(state["serving"], bool) else "its serving is neither true nor false"
    return None if isinstance(state.get("tags"), dict) else "it has neither serving nor tags"


def judge_success(node: Node, response: UpstreamResponse, raw: bytes, parsed: ParsedAnswers,
                  cap: int = MAX_RESULT_BODY_BYTES) -> NodeResult:
    """A 2xx answer: JSON ``"success": false`` makes it a failure; an answer that cannot be judged is one too.

    Over the result cap, a ``"success": false`` could be past what was read;
    a JSON answer that does not parse within bounds says nothing. A text
    answer (SGLang's ``/flush_cache`` says "Cache flushed." in plain text)
    counts as success.
    """
    status = response.status
    if response.is_truncated:
        return NodeResult(node, status=status, reason="oversized_answer",
                          error=f"answer longer than {cap} bytes: cannot tell whether it succeeded",
                          detail=capped_text(raw))
    if not raw.strip():
        return NodeResult(node, status=status, body=None)
    try:
        body = parsed.body(raw)
    except PeerJSONError as exc:
        if "json" in response.content_type.lower():
            return NodeResult(node, status=status, reason="unreadable_answer", error=str(exc),
                              detail=capped_text(raw))
        return NodeResult(node, status=status, body=capped_text(raw))
    if isinstance(body, dict) and _is_not_success(body):
        return NodeResult(node, status=status, reason="success_false", detail=capped_text(raw))
    return NodeResult(node, status=status, body=body)


def _is_not_success(body: dict[str, Any]) -> bool:
    """A 2xx JSON object that does not say it succeeded: its ``success`` is anything but true (false, null,
    ``"false"``), or, without ``success``, it carries an error (``{"error": {"type", "message"}}``)."""
    if "success" in body:
        return body["success"] is not True
    return isinstance(body.get("error"), dict)


# what Starlette's JSONResponse writes: UTF-8, compact, NaN refused
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_encode_str = json.encoder.encode_basestring  # the C function JSONEncoder.encode uses for a str
_RESULT_LISTS = frozenset({"results", "failures", "succeeded", "rolled_back"})
_KEY_TEXTS = {key: f'"{key}":' for key in ("node", "role", "status", "body", "reason", "error", "detail")}


def dumps_answer(payload: dict[str, Any]) -> bytes:
    """A fan-out's answer (the dict :meth:`NodeResult.as_json` entries go in) as the bytes
    ``JSONResponse(payload)`` would send, each node's ``body`` encoded once per distinct object: nodes that
    answered alike share one parsed body (:class:`ParsedAnswers`), so 128 of them cost one encoding of it, not
    128 (about two thirds of the encoding's CPU on a release to 128 nodes)."""
    bodies: dict[int, str] = {}  # id -> text; every body stays referenced by ``payload`` meanwhile
    parts = []
    for key, value in payload.items():
        if key in _RESULT_LISTS and isinstance(value, list):
            text = "[" + ",".join(_dumps_entry(entry, bodies) for entry in value) + "]"
        else:
            text = _ENCODER.encode(value)
        parts.append(_encode_str(key) + ":" + text)
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _dumps_entry(entry: Any, bodies: dict[int, str]) -> str:
    if not isinstance(entry, dict):
        return _ENCODER.encode(entry)
    items = []
    for key, value in entry.items():
        kind = type(value)
        if kind is str:
            text = _encode_str(value)
        elif kind is int:
            text = int.__repr__(value)
        elif key == "body" and (kind is dict or kind is list):
            text = bodies.get(id(value))
            if text is None:
                text = bodies[id(value)] = _ENCODER.encode(value)
        else:
            text = _ENCODER.encode(value)
        items.append((_KEY_TEXTS.get(key) or _encode_str(key) + ":") + text)
    return "{" + ",".join(items) + "}"

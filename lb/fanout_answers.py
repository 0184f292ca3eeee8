"""A fan-out's answers read: the order they come in (:class:`Arrivals`, no task per node) and each node's
answer judged into its :class:`~lb.node_answer.NodeResult` with the state it carried (:func:`answer_of`)."""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from typing import Any

from handoff.protocol.control import NODE_STATE_HEADER
from handoff.service.upstream import (
    ConnectFailed,
    ConnectionDropped,
    PendingRequest,
    ProtocolError,
    UpstreamError,
    UpstreamTimeout,
)
from lb.node import Node
from lb.node_answer import (
    MAX_FAILURE_DETAIL_BYTES,
    MAX_RESULT_BODY_BYTES,
    NodeResult,
    ParsedAnswers,
    capped_text,
    judge_success,
)

_REASONS: tuple[tuple[type[UpstreamError], str], ...] = (
    (ConnectFailed, "unreachable"),
    (UpstreamTimeout, "timeout"),
    (ConnectionDropped, "dropped"),
    (ProtocolError, "protocol_error"),
)


class Arrivals:
    """The indexes of a fan-out's requests in the order their answers come in (one callback per request)."""

    def __init__(self, sent: list[PendingRequest | UpstreamError]) -> None:
        self._ready: deque[int] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        for index, request in enumerate(sent):
            if isinstance(request, UpstreamError):
                self._ready.append(index)
            else:
                request.call_when_answered(functools.partial(self._arrived, index))

    def _arrived(self, index: int) -> None:
        self._ready.append(index)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def next(self) -> int:
        while not self._ready:
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
        return self._ready.popleft()


async def answer_of(node: Node, request: PendingRequest | UpstreamError, timeout_s: float,
                    parsed: ParsedAnswers,
                    cap: int = MAX_RESULT_BODY_BYTES) -> tuple[NodeResult, dict[str, Any] | None]:
    """The node's result and the state its answer carried (None: no answer, or no state header); ``parsed``
    holds what this fan-out's nodes already answered."""
    try:
        if isinstance(request, UpstreamError):
            raise request
        response = await request.response()
        async with response:
            state = parsed.state(response.header(NODE_STATE_HEADER))
            if not 200 <= response.status < 300:
                raw = await response.read(MAX_FAILURE_DETAIL_BYTES)
                return NodeResult(node, status=response.status, reason="http_status",
                                  detail=capped_text(raw)), state
            raw = await response.read(cap)
    except UpstreamError as exc:
        reason = next((name for cls, name in _REASONS if isinstance(exc, cls)), "error")
        error = f"no complete answer within {timeout_s:g} s" if reason == "timeout" else str(exc)
        return NodeResult(node, reason=reason, error=error), None
    return judge_success(node, response, raw, parsed, cap), state

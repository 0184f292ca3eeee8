"""What one PD request's failed pairs leave for the next pick: never the same request twice at a node still on it.

A pair fails when one side did not take the request; the other side's call is given up (its connection closed,
which is how that node learns to abort). That node may still hold the request a moment: its abort has not
landed. SGLang (``TokenizerManager``: "Duplicate request ID detected") and handoff's engine refuse a second
request under an id still in flight, so the same body (the client's ``rid``) sent there again at once fails.

- A node that ran nothing (a :class:`~lb.relay.Reroute`) is excluded for this request; its refusal counts as a
  retry once the next pair is picked (:meth:`PairRetries.take_refusals`), not when no pair is left.
- A node that got the request in a pair that failed is passed over while another node of its role can serve.
- When only such a node is left and it refuses the client's ``rid`` as in flight (a 400 naming the duplicate; for
  a streamed request SGLang's 200 whose first event is that error, peeked at on such a node's stream alone),
  the pair is tried again after a short pause, for at most :data:`ABORT_WAIT_S`: the abort lands meanwhile.
  The client's ``rid`` is never changed; a body without one gets a fresh id at each node.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping, Sequence

from starlette.responses import Response

from handoff.service.upstream import UpstreamError, UpstreamResponse
from lb.config import Role
from lb.node import Node
from lb.pd_refusals import first_event
from lb.relay import Reroute, is_event_stream, translate

log = logging.getLogger(__name__)

DUPLICATE_RID = b"Duplicate request ID detected"  # SGLang's words (tokenizer_manager.py), handoff's engine's too
ABORT_WAIT_S = 5.0  # how long a retry waits in all for a node's abort of this request to land
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 0.5


class PairRetries:
    """One PD request's attempts: ``tried`` (per role, each node excluded with what it answered) and ``sent``
    (nodes that got the request in a pair that failed: avoided while another can serve)."""

    def __init__(self, payload: Mapping[str, Any]) -> None:
        self.tried: dict[Role, dict[Node, str]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self.sent: set[Node] = set()
        self.refusals: list[Reroute] = []  # of the last failed pair, counted once the next pair is picked
        self._has_client_rid = payload.get("rid") is not None
        self._deadline: float | None = None
        self._pause_s = FIRST_PAUSE_S
        self._is_pausing = False

    def record(self, pair: tuple[Node, Node], outcomes: tuple[Any, Any]) -> None:
        """A failed pair's nodes: a node that ran nothing is excluded, any other avoided."""
        for node, out in zip(pair, outcomes):
            if isinstance(out, Reroute):
                self.tried[node.role][node] = out.reason
                self.refusals.append(out)
            else:
                self.sent.add(node)

    def take_refusals(self) -> list[Reroute]:
        """The refusals :meth:`record` noted since the last call: the next pair was picked, so they are retries."""
        refusals, self.refusals = self.refusals, []
        return refusals

    def is_abort_pending(self, node: Node, answer: Response) -> bool:
        """Whether ``answer`` (``node``'s refusal, final otherwise) is the client's ``rid`` still in flight at a
        node this request went to in a pair that failed, within :data:`ABORT_WAIT_S` of the first such refusal
        (past it the refusal is the client's); if so, :meth:`pause` waits before the next pair."""
        if not (self._has_client_rid and node in self.sent and answer.status_code == 400
                and DUPLICATE_RID in bytes(answer.body)):
            return False
        return self._is_within_wait(node)

    async def is_stream_abort_pending(self, sides: Sequence[tuple[Node, UpstreamResponse]], path: str,
                                      timeout_s: float) -> bool:
        """:meth:`is_abort_pending` for a pair whose both sides took the request: whether a streamed side that
        may still hold the client's ``rid`` refused it as in flight (SGLang's 200 whose first event is the
        error). Only such a side's stream is peeked at, its bytes put back; a failure meanwhile is a 502/504
        naming the node (the caller closes both sides)."""
        peeks = {asyncio.ensure_future(first_event(up)): (node, up) for node, up in sides
                 if self._has_client_rid and node in self.sent and is_event_stream(up)}
        pending = set(peeks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for peek in done:
                    node, upstream = peeks[peek]
                    try:
                        head, is_refusal = peek.result()
                    except UpstreamError as exc:
                        node.record_error(str(exc))
                        raise translate(node, path, exc, timeout_s) from exc
                    upstream.unread(head)
                    if is_refusal and DUPLICATE_RID in head and self._is_within_wait(node):
                        return True
            return False
        finally:
            for peek in pending:
                peek.cancel()

    def _is_within_wait(self, node: Node) -> bool:
        now = asyncio.get_running_loop().time()
        if self._deadline is None:
            self._deadline = now + ABORT_WAIT_S
        if now >= self._deadline:
            log.warning("%s still held this request's rid %.0f s after its call was given up", node.url,
                        ABORT_WAIT_S)
            return False
        self._is_pausing = True
        return True

    async def pause(self) -> None:
        """A backoff before the next pair while a node's abort of this request lands (after
        :meth:`is_abort_pending`): 50 ms, doubling to 0.5 s, never past the deadline."""
        if not self._is_pausing or self._deadline is None:
            return
        self._is_pausing = False
        left = self._deadline - asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, min(self._pause_s, left)))
        self._pause_s = min(self._pause_s * 2, MAX_PAUSE_S)

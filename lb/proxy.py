"""Generation routing: ``/generate``, ``/v1/completions``, ``/v1/chat/completions``.

Mixed nodes get the request body untouched, chosen by the policy; with no
routable mixed node and prefill/decode members, the PD protocol (:mod:`lb.pd`)
takes over. A node that refuses the connection, says it does not serve or is
overloaded (it ran nothing) is replaced by another before anything reached the
client; a streamed answer
(``text/event-stream``) is relayed as it arrives, anything else is read whole
and answered with the node's status, type and bytes.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from handoff.service.disconnect import DisconnectWatch
from handoff.service.relay import StreamRelay
from handoff.service.upstream import UpstreamResponse
from handoff.protocol.control import MAX_NAME_CHARS
from handoff.protocol.weights import WEIGHT_VERSION_HEADER, pinned_version
from handoff.service.errors import InvalidRequest
from lb.config import Role
from lb.membership import Membership
from lb.node import Node
from lb.pd import PDDispatcher
from lb.relay import (
    NodeCaller,
    Reroute,
    buffered_response,
    client_gone_response,
    headers_to_node,
    is_event_stream,
    relay_stream,
)
from lb.routing import Router

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class GenerationProxy:
    def __init__(self, membership: Membership, router: Router, caller: NodeCaller,
                 node_headers: dict[str, str]) -> None:
        self._membership = membership
        self._router = router
        self._caller = caller
        self._node_headers = node_headers
        self._pd = PDDispatcher(router, caller)

    def _is_pd(self) -> bool:
        has_pd_members = bool(self._membership.nodes(Role.PREFILL) or self._membership.nodes(Role.DECODE))
        return has_pd_members and not self._router.has_routable(Role.MIXED)

    async def handle(self, request: Request, path: str) -> Response:
        """Route one generation request; a client that leaves cancels it (answered 499, never sent)."""
        try:
            body = await request.body()
        except ClientDisconnect:
            return client_gone_response()
        headers = headers_to_node(request.scope["headers"], self._node_headers)
        pinned = headers.get(WEIGHT_VERSION_HEADER)
        version = None if pinned is None else pinned_version(pinned)
        if pinned is not None and version is None:  # no node could ever serve it: not a 503
            raise InvalidRequest(f"{WEIGHT_VERSION_HEADER} must be a version of 1 to {MAX_NAME_CHARS} characters "
                                 f"in UTF-8, got {len(pinned)} bytes")
        watch = DisconnectWatch(request.receive, request.scope)
        is_handed_over = False
        try:
            if self._is_pd():
                response = await self._pd.dispatch(path, body, headers, watch, version)
            else:
                response = await self._dispatch_mixed(path, body, headers, watch, version)
            is_handed_over = isinstance(response, StreamRelay)
            return response
        except asyncio.CancelledError:
            if not watch.is_disconnected:
                raise
            watch.absorb_cancel()
            return client_gone_response()
        finally:
            if not is_handed_over:
                watch.stop()

    async def _dispatch_mixed(self, path: str, body: bytes, headers: dict[str, str], watch: DisconnectWatch,
                              weight_version: str | None) -> Response:
        """A mixed node picked by the policy (of those serving ``weight_version``, when the request pins one)."""
        tried: dict[Node, str] = {}  # each node this request went to, and why it went on
        refused: Reroute | None = None  # the last node's refusal, counted once another node is picked
        while True:
            node = self._router.pick(Role.MIXED, tried, weight_version=weight_version)
            if refused is not None:
                self._caller.count_retry(refused)
            with node.begin_request() as lease:
                outcome = await self._caller.call(node, path, body, headers)
                if isinstance(outcome, Reroute):
                    tried[node], refused = outcome.reason, outcome
                    continue
                if isinstance(outcome, UpstreamResponse):
                    if is_event_stream(outcome):
                        return relay_stream(outcome, lease.hand_over(), path, watch, cut=self._caller.streams_cut)
                    return buffered_response(outcome, await self._caller.read_body(node, outcome, path))
                return outcome


"""Counting answered requests by the status their clients got, for the LB and the sidecar alike.

A status is read from the ``http.response.start`` message actually sent, never
from a peer's answer: a relay that turns an engine's 200 into a 502 (an
answer over the size cap, a body cut short) counts the 502. A request that
raised before anything was sent counts 500, the answer the unexpected-error
middleware gives it.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

RouteOf = Callable[[Scope], "str | None"]


class CountByStatus:
    """ASGI middleware: each HTTP request that ``route_of`` names (None: not counted) is counted once in
    ``counter`` (labels ``route_label``, ``route`` unless told, and ``code``) when its answer is done."""

    def __init__(self, app: ASGIApp, counter: Counter, route_of: RouteOf, route_label: str = "route") -> None:
        self.app = app
        self._counter = counter
        self._route_of = route_of
        self._route_label = route_label
        self._children: dict[tuple[str, int], Any] = {}  # labels resolved once per (route, status)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._route_of(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            child = self._children.get((route, status))
            if child is None:
                labels = {self._route_label: route, "code": str(status)}
                child = self._children[(route, status)] = self._counter.labels(**labels)
            child.inc()

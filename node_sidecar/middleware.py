"""The sidecar's two ASGI middlewares: the generation fast path, and the node state on every control answer."""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.protocol.control import NODE_STATE_HEADER
from node_sidecar.node import Node
from node_sidecar.node_views import state_header

AsgiHandler = Callable[[Scope, Receive, Send], Awaitable[None]]

_STATE_HEADER = NODE_STATE_HEADER.encode()


class GenerationFastPath:
    """``POST`` to a generation path goes straight to its handler; every other request goes on to ``app``.

    It sits inside the body limit and the unexpected-error middleware, so a
    generation gets the same 413 and 500 answers as before; what it skips is
    FastAPI's routing, dependency solving and exception middleware, a third to
    a half of the sidecar's CPU per proxied request (bench/sidecar_overhead.py).
    The handlers answer :class:`ServiceError` with its envelope themselves. The
    FastAPI routes for these paths stay (OpenAPI, and other methods get their
    405 from there).
    """

    def __init__(self, app: ASGIApp, handlers: dict[str, AsgiHandler]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.app(scope, receive, send)


class NodeStateHeader:
    """Every answer to a control call (success or error) carries the node's state in :data:`NODE_STATE_HEADER`,
    read when the answer starts, after the call did its work: the LB routes by it without asking again."""

    def __init__(self, app: ASGIApp, node: Callable[[], Node], paths: frozenset[str]) -> None:
        self.app = app
        self._node = node
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self.app(scope, receive, send)
            return

        async def send_with_state(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = state_header(self._node())
                if value is not None:
                    message = {**message, "headers": [*message.get("headers", []), (_STATE_HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_state)

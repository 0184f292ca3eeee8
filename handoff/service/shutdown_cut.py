"""What a request cut by a graceful shutdown answers: :class:`ShutdownCut`, the outermost ASGI layer of a service.

On SIGTERM uvicorn stops taking connections, gives the requests in flight
``--shutdown-timeout`` and then cancels their tasks. Left to uvicorn, a request
cut before its answer started got a ``text/plain`` 500 "Internal Server Error"
and a traceback in the log, and an event stream just stopped. Here the first
is a 503 ``unavailable`` envelope naming the shutdown, an event stream ends
with one error event (and no ``[DONE]``: the answer is not complete), and the
log has one line per request cut.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.protocol import errors as E
from handoff.service.errors import error_response
from handoff.service.relay import sse_error_event

log = logging.getLogger(__name__)


class ShutdownCut:
    """Wraps ``app``; ``grace_s`` is the shutdown timeout the answers name."""

    def __init__(self, app: ASGIApp, *, grace_s: float) -> None:
        self.app = app
        self.message = (f"the service is shutting down: this request did not finish within its shutdown timeout "
                        f"({grace_s:g} s) and was cut")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started: Message | None = None
        ended = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = message
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if ended:
                return
            log.warning("%s %s cut by the shutdown", scope.get("method"), scope.get("path"))
            if started is None:
                await error_response(E.UNAVAILABLE.status, E.UNAVAILABLE.name, self.message)(scope, receive, send)
            elif _is_event_stream(started):
                await send({"type": "http.response.body", "body": sse_error_event(E.UNAVAILABLE.name, self.message),
                            "more_body": False})
            # any other answer under way: its connection closes with it cut short, which is all that is honest


def _is_event_stream(start: Message) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
               for name, value in start.get("headers", ()))

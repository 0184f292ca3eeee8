"""Request body limit (413) as a thin ASGI middleware.

A declared ``Content-Length`` above the limit is refused before the body is
read; a chunked body is counted as it arrives and refused as soon as it passes
the limit, so nothing larger than the limit is ever buffered. A route that
answers without reading the body (``/continue_generation``, the views) has the
rest of it read, counted and dropped before its answer goes out, so a body over
the limit is a 413 there too, not a 200 that ignored it.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.protocol import errors as E
from handoff.service.errors import PayloadTooLarge, error_envelope

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await _send_413(send, limit)
                    return
                break
        num_received = 0
        is_exceeded = False
        is_body_read = False

        async def limited_receive() -> Message:
            nonlocal num_received, is_exceeded, is_body_read
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    is_body_read = True
                if num_received > limit:
                    is_exceeded = True
                    raise PayloadTooLarge(f"request body is larger than {limit} bytes")
            elif message["type"] == "http.disconnect":
                is_body_read = True
            return message

        async def checked_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not is_body_read and not is_exceeded:
                try:  # the app answers without having read the body: count the rest before answering
                    while not is_body_read:
                        await limited_receive()
                except PayloadTooLarge:
                    pass  # is_exceeded: the answer becomes the 413 below
            # Whatever the app made of the interrupted read (FastAPI turns it into a 400), the answer is 413.
            if not is_exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await _send_413(send, limit)

        await self.app(scope, limited_receive, checked_send)


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps(error_envelope(E.PAYLOAD_TOO_LARGE.name, f"request body is larger than {limit} bytes")).encode()
    await send({
        "type": "http.response.start",
        "status": 413,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})

"""Request body limits, in size (413) and time (408), as a thin ASGI middleware.

A declared ``Content-Length`` above the limit is refused before the body is
read; a chunked body is counted as it arrives and refused as soon as it passes
the limit, so nothing larger than the limit is ever buffered. A route that
answers without reading the body (``/continue_generation``, the views) has the
rest of it read, counted and dropped before its answer goes out, so a body over
the limit is a 413 there too, not a 200 that ignored it.

With ``body_timeout_s``, the whole body must arrive within that time of the
request's head: a client that declares 100 bytes and sends 9 gets a 408 and
its connection closed, instead of holding a handler (and, in a sidecar, a
place in flight that every drain would wait for) for as long as it likes.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.service.errors import PayloadTooLarge, RequestTimeout, ServiceError

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0
# a peer's non-stream answer is buffered whole (so a failure midway is a status): this bounds it (LB, sidecar)
DEFAULT_MAX_ANSWER_BYTES = 256 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

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
                    await _send_refusal(send, PayloadTooLarge(f"request body is larger than {limit} bytes"))
                    return
                break
        num_received = 0
        refusal: ServiceError | None = None
        is_body_read = False
        loop = asyncio.get_running_loop()
        body_deadline = None if self.body_timeout_s is None else loop.time() + self.body_timeout_s

        async def limited_receive() -> Message:
            nonlocal num_received, refusal, is_body_read
            if is_body_read or body_deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, body_deadline - loop.time()))
                except asyncio.TimeoutError:
                    refusal = RequestTimeout(f"the request body did not arrive within {self.body_timeout_s:g} s")
                    raise refusal from None
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    is_body_read = True
                if num_received > limit:
                    refusal = PayloadTooLarge(f"request body is larger than {limit} bytes")
                    raise refusal
            elif message["type"] == "http.disconnect":
                is_body_read = True
            return message

        is_started = False

        async def checked_send(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start" and not is_body_read and refusal is None:
                try:  # the app answers without having read the body: count the rest before answering
                    while not is_body_read:
                        await limited_receive()
                except (PayloadTooLarge, RequestTimeout):
                    pass  # the refusal is the answer below
            # Whatever the app made of the interrupted read (FastAPI turns it into a 400), the answer is the refusal.
            if refusal is None:
                await send(message)
            elif message["type"] == "http.response.start":
                await _send_refusal(send, refusal)
            is_started = is_started or message["type"] == "http.response.start"

        try:
            await self.app(scope, limited_receive, checked_send)
        except (PayloadTooLarge, RequestTimeout) as exc:  # an app that let the refusal through
            if exc is not refusal or is_started:
                raise
            await _send_refusal(send, refusal)


async def _send_refusal(send: Send, refusal: ServiceError) -> None:
    """The 413 or 408; the connection closes (the rest of the body is not worth reading)."""
    body = json.dumps(refusal.envelope()).encode()
    await send({
        "type": "http.response.start",
        "status": refusal.status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": body})

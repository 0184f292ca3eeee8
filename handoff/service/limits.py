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
place in flight that every drain would wait for) for as long as it likes. A
body that did arrive in time is never refused because the app read it late.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.service.errors import PayloadTooLarge, RequestTimeout, ServiceError

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0
_BUFFERED_GRACE_S = 0.05
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
        if _declared_length(scope) > self.max_body_bytes:
            await _send_refusal(send, PayloadTooLarge(f"request body is larger than {self.max_body_bytes} bytes"))
            return
        exchange = _LimitedExchange(receive, send, self.max_body_bytes, self.body_timeout_s)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except (PayloadTooLarge, RequestTimeout) as exc:  # an app that let the refusal through
            if exc is not exchange.refusal or exchange.is_started:
                raise
            await _send_refusal(send, exchange.refusal)


class _LimitedExchange:
    """One request's body, counted and timed as the app reads it; its answer, held back for a refusal."""

    def __init__(self, receive: Receive, send: Send, max_body_bytes: int, body_timeout_s: float | None) -> None:
        self._receive = receive
        self._send = send
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._loop = asyncio.get_running_loop()
        self._body_deadline = None if body_timeout_s is None else self._loop.time() + body_timeout_s
        self._num_received = 0
        self.is_body_read = False
        self.is_started = False
        self.refusal: ServiceError | None = None

    async def receive(self) -> Message:
        if self.is_body_read or self._body_deadline is None:
            message = await self._receive()
        else:
            try:
                # Past the deadline, what the client sent in time is buffered and comes at once: an app that
                # was busy before reading (a control call waiting for a lock) must not make it a 408.
                remaining = max(_BUFFERED_GRACE_S, self._body_deadline - self._loop.time())
                async with asyncio.timeout(remaining):  # not wait_for: no task per message (about 4 us)
                    message = await self._receive()
            except TimeoutError:
                self.refusal = RequestTimeout(f"the request body did not arrive within {self._body_timeout_s:g} s")
                raise self.refusal from None
        if message["type"] == "http.request":
            self._num_received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.is_body_read = True
            if self._num_received > self._max_body_bytes:
                self.refusal = PayloadTooLarge(f"request body is larger than {self._max_body_bytes} bytes")
                raise self.refusal
        elif message["type"] == "http.disconnect":
            self.is_body_read = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.is_body_read and self.refusal is None:
            try:  # the app answers without having read the body: count the rest before answering
                while not self.is_body_read:
                    await self.receive()
            except (PayloadTooLarge, RequestTimeout):
                pass  # the refusal is the answer below
        # Whatever the app made of the interrupted read (FastAPI turns it into a 400), the answer is the refusal.
        if self.refusal is None:
            await self._send(message)
        elif message["type"] == "http.response.start":
            await _send_refusal(self._send, self.refusal)
        self.is_started = self.is_started or message["type"] == "http.response.start"


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length (0 when absent or not a number: the count as it arrives decides)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


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

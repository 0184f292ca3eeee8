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
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.protocol import errors as E
from handoff.service.errors import PayloadTooLarge, RequestTimeout, ServiceError, Unavailable

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0
_BUFFERED_GRACE_S = 0.05
# a peer's non-stream answer is buffered whole (so a failure midway is a status): this bounds it (LB, sidecar)
DEFAULT_MAX_ANSWER_BYTES = 256 * 1024 * 1024
# the bodies of all requests a process holds at once (sixteen bodies of the largest size)
DEFAULT_MAX_BUFFERED_BODY_BYTES = 1024 * 1024 * 1024
OVERLOADED_RETRY_AFTER_S = 1


class BodyBudget:
    """The bytes of request bodies that every request of this process holds at once, and their bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def take(self, num_bytes: int) -> bool:
        """Count ``num_bytes`` more, unless they would pass the bound (then count nothing: False)."""
        if self.in_use + num_bytes > self.limit:
            return False
        self.in_use += num_bytes
        return True

    def give_back(self, num_bytes: int) -> None:
        self.in_use -= num_bytes


class BudgetShare:
    """The bytes one request holds in a :class:`BodyBudget`, owned by a ``with`` block: :meth:`take` counts more
    (or raises what ``refusal`` makes of the budget and the bytes asked, counting nothing), and leaving the block
    gives every byte back at once. A share outside its block takes nothing (its taker gets the refusal)."""

    def __init__(self, budget: BodyBudget, refusal: Callable[[BodyBudget, int], ServiceError]) -> None:
        self._budget = budget
        self._refusal = refusal
        self.num_bytes = 0
        self._is_open = False

    def take(self, num_bytes: int) -> None:
        if not self._is_open or not self._budget.take(num_bytes):
            raise self._refusal(self._budget, num_bytes)
        self.num_bytes += num_bytes

    def __enter__(self) -> BudgetShare:
        self._is_open = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._is_open = False
        self._budget.give_back(self.num_bytes)
        self.num_bytes = 0


BODY_BUDGET = BodyBudget(DEFAULT_MAX_BUFFERED_BODY_BYTES)  # one per process, shared by every BodyLimitMiddleware


def _overloaded(budget: BodyBudget) -> Unavailable:
    return Unavailable(f"this process holds {budget.in_use} bytes of request bodies, up to its limit of "
                       f"{budget.limit} (--max-buffered-body-bytes); try again shortly",
                       type=E.OVERLOADED.name, retry_after=OVERLOADED_RETRY_AFTER_S)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float | None = None, budget: BodyBudget | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.budget = BODY_BUDGET if budget is None else budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_body_bytes:
            await _send_refusal(send, PayloadTooLarge(f"request body is larger than {self.max_body_bytes} bytes"))
            return
        exchange = _LimitedExchange(receive, send, self.max_body_bytes, self.body_timeout_s, self.budget)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except (PayloadTooLarge, RequestTimeout, Unavailable) as exc:  # an app that let the refusal through
            if exc is not exchange.refusal or exchange.is_started:
                raise
            await exchange.send_refusal()
        finally:
            self.budget.give_back(exchange.num_counted)


class _LimitedExchange:
    """One request's body, counted and timed as the app reads it; its answer, held back for a refusal."""

    def __init__(self, receive: Receive, send: Send, max_body_bytes: int, body_timeout_s: float | None,
                 budget: BodyBudget) -> None:
        self._receive = receive
        self._budget = budget
        # Bytes taken from the budget as they arrive (what is really held), given back when the request is done.
        # Not the declared length at once: sixteen connections declaring 64 MiB and sending nothing would hold
        # a 1 GiB budget, and every other client's body, for the body timeout.
        self.num_counted = 0
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
            num_bytes = len(message.get("body", b""))
            self._num_received += num_bytes
            if not message.get("more_body", False):
                self.is_body_read = True
            if self._num_received > self._max_body_bytes:
                self.refusal = PayloadTooLarge(f"request body is larger than {self._max_body_bytes} bytes")
                raise self.refusal
            if num_bytes:
                if not self._budget.take(num_bytes):
                    self.refusal = _overloaded(self._budget)
                    raise self.refusal
                self.num_counted += num_bytes
        elif message["type"] == "http.disconnect":
            self.is_body_read = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.is_body_read and self.refusal is None:
            try:  # the app answers without having read the body: count the rest before answering
                while not self.is_body_read:
                    await self.receive()
            except (PayloadTooLarge, RequestTimeout, Unavailable):
                pass  # the refusal is the answer below
        # Whatever the app made of the interrupted read (FastAPI turns it into a 400), the answer is the refusal.
        if self.refusal is None:
            await self._send(message)
        elif message["type"] == "http.response.start":
            await self.send_refusal()
        self.is_started = self.is_started or message["type"] == "http.response.start"

    async def send_refusal(self) -> None:
        """The refusal as the answer. Refused for the budget (503), the rest of the body is first read and
        dropped (never held), so a client that sends its whole body before it reads gets the 503, not a reset
        connection; a 413 or 408 closes at once."""
        if isinstance(self.refusal, Unavailable):
            await self._drop_rest()
        if self.refusal is not None:
            await _send_refusal(self._send, self.refusal)

    async def _drop_rest(self) -> None:
        remaining = None if self._body_deadline is None else max(0.0, self._body_deadline - self._loop.time())
        try:
            async with asyncio.timeout(remaining):
                while not self.is_body_read:
                    message = await self._receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        self.is_body_read = True
        except TimeoutError:
            return  # what did not come in time is not waited for: the answer goes out, the connection closes


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
    """The 413, 408 or 503; the connection closes (the rest of the body is not worth reading)."""
    body = json.dumps(refusal.envelope()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in refusal.headers.items()]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

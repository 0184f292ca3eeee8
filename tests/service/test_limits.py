"""The body deadline refuses a client that stalls in its body, never one whose body came in time and was read
late by a busy app (found in CI: a sidecar's ``/flush_cache`` that waited over a minute for its engine to go
idle answered 408 "the request body did not arrive within 60 s" for a two-byte body sent at once)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message, Receive, Scope, Send

from handoff.service.limits import BodyLimitMiddleware

pytestmark = pytest.mark.timeout(10)

SCOPE = {"type": "http", "method": "POST", "path": "/flush_cache", "headers": [(b"content-length", b"2")]}


async def answered_status(receive: Receive, *, busy_s: float, reads_body: bool) -> int:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(busy_s)  # waiting for a lock, an engine going idle, ...
        if reads_body:
            await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await BodyLimitMiddleware(app, body_timeout_s=0.2)(SCOPE, receive, send)
    return sent[0]["status"]


@pytest.mark.parametrize("reads_body", [True, False])
async def test_a_body_that_came_in_time_is_taken_however_late_the_app_reads_it(reads_body: bool) -> None:
    async def buffered() -> Message:  # the body arrived with the head
        return {"type": "http.request", "body": b"{}", "more_body": False}

    assert await answered_status(buffered, busy_s=0.5, reads_body=reads_body) == 200


@pytest.mark.parametrize("reads_body", [True, False])
async def test_a_body_that_never_comes_is_a_408(reads_body: bool) -> None:
    async def stalled() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    assert await answered_status(stalled, busy_s=0.0, reads_body=reads_body) == 408
    assert await answered_status(stalled, busy_s=0.5, reads_body=reads_body) == 408

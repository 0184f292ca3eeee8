"""The lifespan half of a bare ASGI test app served by uvicorn in a thread."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send


async def answered_lifespan(scope: Scope, receive: Receive, send: Send) -> bool:
    """True when ``scope`` is the lifespan, then answered here to its shutdown: ``if await answered_lifespan(...):
    return`` opens an app that serves only requests."""
    if scope["type"] != "lifespan":
        return False
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
    return True

"""A bare ASGI test app served by uvicorn: its lifespan half, and serving it on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any, AsyncIterator

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send


async def answered_lifespan(scope: Scope, receive: Receive, send: Send) -> bool:
    """True when ``scope`` is the lifespan, then answered here to its shutdown: ``if await answered_lifespan(...):
    return`` opens an app that serves only requests."""
    if scope["type"] != "lifespan":
        return False
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
    return True


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, protocol: type, **config: Any) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """``app`` served by uvicorn on this event loop, at an ephemeral port of 127.0.0.1, through the HTTP protocol
    class ``protocol`` (``config``: more of ``uvicorn.Config``): the server and its port once it has started
    (within 10 s); stopped (within 10 s) on leaving."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_config=None, **config))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {task!r}")
            await asyncio.sleep(0.01)
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)

"""A real HTTP server whose answers a test scripts: for client tests and fault injection.

``POST /_script`` with ``[{"status": 503, "headers": {...}, "body": {...}}, ...]`` replaces the queued answers
(``"raw": "text"`` instead of ``"body"`` sends that text as it is, e.g. an SSE stream with its own
``Content-Type`` header);
every other request takes the next one (or ``{"ok": true}`` when the queue is empty) and is recorded;
``GET /_requests`` returns what was received (method, path, query, headers, body).
An answer ``{"gather": N}`` is held until N requests are held at once (at most 10 s), then answers
``{"gathered": the most held at once}``: how many requests a client had in flight together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import deque
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from handoff.service.serve import add_server_args, serve


def create_app() -> Starlette:
    script: deque[dict[str, Any]] = deque()
    received: list[dict[str, Any]] = []
    gathering = {"held": 0, "most": 0}
    gathered = asyncio.Event()

    async def gather(wanted: int) -> Response:
        gathering["held"] += 1
        gathering["most"] = max(gathering["most"], gathering["held"])
        if gathering["held"] >= wanted:
            gathered.set()
        with contextlib.suppress(TimeoutError):  # fewer came: the answer says how many
            await asyncio.wait_for(gathered.wait(), 10)
        gathering["held"] -= 1
        return JSONResponse({"gathered": gathering["most"]})

    async def set_script(request: Request) -> Response:
        script.clear()
        script.extend(await request.json())
        return JSONResponse({"queued": len(script)})

    async def get_requests(_: Request) -> Response:
        return JSONResponse(received)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def anything(request: Request) -> Response:
        body = await request.body()
        received.append({"method": request.method, "path": request.url.path, "query": request.url.query,
                         "headers": dict(request.headers), "body": body.decode("utf-8", "replace")})
        answer = script.popleft() if script else {"status": 200, "body": {"ok": True}}
        if "gather" in answer:
            return await gather(answer["gather"])
        content = answer["raw"] if "raw" in answer else json.dumps(answer.get("body", {}))
        return Response(content, status_code=answer.get("status", 200),
                        headers=answer.get("headers", {}), media_type="application/json")

    return Starlette(routes=[
        Route("/_script", set_script, methods=["POST"]),
        Route("/_requests", get_requests, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/{path:path}", anything, methods=["GET", "POST", "DELETE"]),
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_server_args(parser, default_host="127.0.0.1", default_port=0)
    args = parser.parse_args()
    serve(create_app(), host=args.host, port=args.port, port_file=args.port_file)

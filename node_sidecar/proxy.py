"""Generation through the sidecar: admitted, counted in flight to the last byte, relayed as it comes.

The body goes to the engine untouched. A stream is relayed chunk by chunk with
its SSE framing as the engine wrote it; a non-stream answer is read whole and
passed on with the engine's status. A client that goes away closes the engine
connection, which aborts the request in the engine. An engine that dies
mid-stream ends the stream with an error event, never a silent cut.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from handoff.service.disconnect import ClientGone, unless_disconnected
from handoff.service.upstream import UpstreamError, UpstreamResponse
from node_sidecar.errors import EngineUnavailable
from node_sidecar.node import Node

CLIENT_CLOSED = 499
MAX_ANSWER_BYTES = 256 * 1024 * 1024
_DONE = b"data: [DONE]\n\n"


def _answer_headers(upstream: UpstreamResponse) -> dict[str, str]:
    headers = {"Content-Type": upstream.content_type or "application/json"}
    retry_after = upstream.header("retry-after")
    if retry_after:
        headers["Retry-After"] = retry_after
    return headers


class _CountedResponse(Response):
    """A response that runs ``on_done`` once it was sent (or failed to be)."""

    def __init__(self, content: bytes, status_code: int, headers: dict[str, str], on_done: Callable[[], None]) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_done()


class _RelayedStream(StreamingResponse):
    """The engine's stream, relayed; ``on_done`` runs after the last byte or the client's disconnect."""

    def __init__(self, node: Node, upstream: UpstreamResponse, on_done: Callable[[], None]) -> None:
        super().__init__(self._chunks(), status_code=upstream.status, headers=_answer_headers(upstream))
        self._node = node
        self._upstream = upstream
        self._on_done = on_done

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._upstream.aiter_bytes():
                yield chunk
        except UpstreamError as exc:
            self._node.mark_unreachable(exc)
            error = {"error": {"type": "engine_unavailable", "message": f"the engine failed mid-stream: {exc}"}}
            yield b"data: " + json.dumps(error).encode() + b"\n\n" + _DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._upstream.close()  # a stream cut short closes the engine connection: the engine aborts
            self._on_done()


async def relay_generation(node: Node, request: Request, path: str, on_status: Callable[[int], None]) -> Response:
    """Admit (hold or 503), forward to the engine, and relay its answer."""
    admission = node.admission
    await admission.enter()
    try:
        body = await request.body()
        target = path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await node.engine.open(
            "POST", target, body=body, timeout=node.config.generate_timeout,
            headers={"Content-Type": request.headers.get("content-type", "application/json")})
    except BaseException:
        admission.leave()
        raise
    on_status(upstream.status)
    if upstream.content_type.startswith("text/event-stream"):
        return _RelayedStream(node, upstream, admission.leave)
    try:
        content = await unless_disconnected(request, upstream.read(MAX_ANSWER_BYTES))
    except ClientGone:
        upstream.close()
        admission.leave()
        return Response(status_code=CLIENT_CLOSED)
    except UpstreamError as exc:
        upstream.close()
        admission.leave()
        node.mark_unreachable(exc)
        raise EngineUnavailable(f"the engine failed while answering: {exc}", retry_after=1) from exc
    except BaseException:
        upstream.close()
        admission.leave()
        raise
    return _CountedResponse(content, upstream.status, _answer_headers(upstream), admission.leave)


async def forward(node: Node, request: Request, path: str, *, timeout: float = 30.0) -> Response:
    """A plain pass-through of a non-generation engine endpoint."""
    body = await request.body()
    target = path + (f"?{request.url.query}" if request.url.query else "")
    headers: dict[str, Any] = {"Content-Type": request.headers.get("content-type", "application/json")} if body else {}
    upstream = await node.engine.open(request.method, target, body=body, headers=headers, timeout=timeout)
    try:
        content = await upstream.read(MAX_ANSWER_BYTES)
    except UpstreamError as exc:
        node.mark_unreachable(exc)
        raise EngineUnavailable(f"the engine failed while answering: {exc}", retry_after=1) from exc
    finally:
        upstream.close()
    return Response(content, status_code=upstream.status, headers=_answer_headers(upstream))

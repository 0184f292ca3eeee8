"""Generation through the sidecar: admitted, counted in flight to the last byte, relayed as it comes.

An admitted request's body and buffered answer count against ``--max-inflight-bytes``
(:mod:`node_sidecar.inflight_bytes`) until its place in flight is given back.

The body goes to the engine untouched (one that names media an engine not
handoff's would fetch or read on its own is screened first:
:mod:`node_sidecar.media`). A stream is relayed chunk by chunk with
its SSE framing as the engine wrote it; a non-stream answer is read whole and
passed on with the engine's status, in pieces (:class:`WholeAnswer`): it stays
counted, its bytes too, until its last piece went to the connection, and a
client that stops reading is cut as a stream's is (an aborting drain, the
generation deadline). A client that goes away closes the engine
connection, which aborts the request in the engine. An engine that dies
mid-stream ends the stream with an error event, never a silent cut.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from handoff.protocol import errors as E
from handoff.protocol.errors import NotServingReason
from handoff.protocol.weights import WEIGHT_VERSION_HEADER, pinned_version
from handoff.service.disconnect import CLIENT_CLOSED, DisconnectWatch
from handoff.service.errors import NotServing
from handoff.service.relay import ChunkTransform, StreamRelay, WholeAnswer, relayed_headers, sse_error_event
from handoff.service.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from node_sidecar.admission import InFlight
from node_sidecar.engine_client import generation_overdue
from node_sidecar.engines.base import EngineAdapter
from node_sidecar.inflight_bytes import BytesLease
from node_sidecar.media import MediaPolicy, may_hold_media, screen_body
from node_sidecar.node import Node



def _answer(upstream: UpstreamResponse, content: bytes) -> Response:
    """The engine's answer, read whole, with the headers a relay passes on."""
    response = Response(content, status_code=upstream.status)
    response.raw_headers = _whole_answer_headers(upstream, content)
    return response


def _whole_answer_headers(upstream: UpstreamResponse, content: bytes) -> list[tuple[bytes, bytes]]:
    return [*relayed_headers(upstream, default_type=b"application/json"),
            (b"content-length", str(len(content)).encode())]


def _relayed_stream(node: Node, upstream: UpstreamResponse, release: Callable[[], None],
                    transform: ChunkTransform | None) -> StreamRelay:
    """The engine's stream, relayed; ``release`` (its place in flight, its body's bytes) runs after the last byte
    or the client's disconnect.
    An engine failing mid-stream ends it with an ``engine_unavailable`` event."""

    def failed(exc: UpstreamError) -> bytes:
        if isinstance(exc, UpstreamTimeout):  # slow, not gone (engine_client.py's module docstring)
            overdue = generation_overdue(exc, node.config.generate_timeout)
            return sse_error_event(overdue.type, overdue.message)
        node.mark_unreachable(exc)
        return sse_error_event(E.ENGINE_UNAVAILABLE.name, f"the engine failed mid-stream: {exc}")

    return StreamRelay(upstream, on_failure=failed, on_close=lambda _: release(), transform=transform,
                       default_type=b"application/json")


async def relay_generation(node: Node, request: Request, path: str) -> Response:
    """Read the whole body, admit (hold or 503), forward to the engine, and relay its answer.

    The body comes first: a client that stalls in its body (the body limit
    middleware gives it a deadline) is never counted in flight, so no drain
    waits for it. From the body's end until the answer is in hand, a client
    disconnect cancels the wait: a held request leaves the queue uncounted (it
    would otherwise run for nobody once the node serves again, and a drain
    would wait for it); an admitted one closes the engine connection (a
    non-stream answer's headers come only with the whole answer), and the
    engine aborts.
    """
    try:
        body = await request.body()
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    query = request.scope.get("query_string", b"").decode("latin-1")
    # The engine's form of the request, made before it is admitted (a body the engine cannot serve is a 400 that
    # never counts in flight); before the engine's kind is known the node does not serve, so admission decides.
    call = None
    if node.adapter is not None:
        await _screen_media(node, node.adapter, body)
        call = node.adapter.generation_call(path, body, query)
    # from here a client that leaves cancels the wait: held, or for the answer
    watch = DisconnectWatch(request.receive, request.scope)
    try:
        lease = await node.admission.enter(num_bytes=len(body))
    except asyncio.CancelledError:
        watch.stop()
        if not watch.is_disconnected:
            raise
        watch.absorb_cancel()
        return Response(status_code=CLIENT_CLOSED)  # left while held: never admitted, never counted
    except BaseException:
        watch.stop()
        raise
    held = node.inflight_bytes.lease()
    release = _releasing(lease, held)
    try:
        held.take_body(len(body))  # past the bound: 503 overloaded, nothing sent
        _check_pinned_version(node, request)
        if call is None:
            await _screen_media(node, node.engine_adapter, body)
            call = node.engine_adapter.generation_call(path, body, query)
        timeout = node.config.generate_timeout
        upstream = await node.engine.open(
            "POST", call.path, body=call.body, timeout=timeout, is_generation=True,
            headers={"Content-Type": request.headers.get("content-type", "application/json")})
        if upstream.content_type.startswith("text/event-stream"):
            watch.stop()  # the stream's own watcher takes over
            relay = _relayed_stream(node, upstream, release, call.stream() if call.stream else None)
            lease.on_abort(relay.cut_if_stalled)  # an aborting drain cuts it if only its client holds it
            return relay
        content = await node.engine.read(upstream, node.config.max_answer_bytes, is_generation=True, timeout=timeout,
                                         count=held.take_answer)
        if call.answer is not None and 200 <= upstream.status < 300:
            content = call.answer(content)
        answer = WholeAnswer(content, status=upstream.status, headers=_whole_answer_headers(upstream, content),
                             on_close=release, deadline=upstream.deadline)
        lease.on_abort(answer.cut_if_stalled)  # counted to its last byte: a client not reading holds it
    except asyncio.CancelledError:
        release()
        if not watch.is_disconnected:
            raise
        watch.absorb_cancel()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        release()
        raise
    finally:
        watch.stop()
    return answer


def _releasing(lease: InFlight, held: BytesLease) -> Callable[[], None]:
    """Gives back the request's place in flight and its bytes, together (each once)."""

    def release() -> None:
        held.release()
        lease.release()

    return release


async def _screen_media(node: Node, adapter: EngineAdapter, body: bytes) -> None:
    """400 for a media item the node keeps from an engine that loads media on its own; a body without one is not
    parsed, one with one is parsed off the event loop."""
    if adapter.screens_media and may_hold_media(body):
        policy = MediaPolicy(node.config.allowed_local_media_path, node.config.refuse_media_urls)
        await asyncio.to_thread(screen_body, body, policy)


def _check_pinned_version(node: Node, request: Request) -> None:
    """A request pinned to a weight version (header) runs only on that version: checked once admitted, when no
    update can start before it ends (updates drain first)."""
    pinned = request.headers.get(WEIGHT_VERSION_HEADER)
    version = None if pinned is None else pinned_version(pinned)  # read as UTF-8, as the LB reads it
    if pinned is not None and (version is None or version != node.state.weight_version):
        raise NotServing(f"this node serves weight_version {node.state.weight_version!r}, not {pinned!r}",
                         NotServingReason.WEIGHT_VERSION_UNAVAILABLE, retry_after=node.config.retry_after_s,
                         extra={"weight_version": node.state.weight_version})


async def forward(node: Node, request: Request, path: str, *, timeout: float = 30.0,
                  max_bytes: int | None = None) -> Response:
    """A plain pass-through of a non-generation engine endpoint (an answer over ``max_bytes``, by default
    ``--max-answer-bytes``, is a 502)."""
    body = await request.body()
    target = path + (f"?{request.url.query}" if request.url.query else "")
    headers: dict[str, Any] = {"Content-Type": request.headers.get("content-type", "application/json")} if body else {}
    upstream = await node.engine.open(request.method, target, body=body, headers=headers, timeout=timeout)
    content = await node.engine.read(upstream, node.config.max_answer_bytes if max_bytes is None else max_bytes)
    return _answer(upstream, content)

"""Relaying a peer's answer to the client: the one mechanism of the LB (in front of a node) and the sidecar
(in front of its engine).

- :data:`RELAYED_RESPONSE_HEADERS`: what passes back from a peer's answer: the
  headers that describe the relayed bytes or ask something of the client (its
  type and encoding, so a gzip body stays a gzip body; caching; a
  ``Retry-After``; the request id). Framing headers (length, chunking,
  connection) are the relay's own; anything else a peer says stays with it.
- :class:`StreamRelay`: a streamed answer, chunk by chunk as it arrives. A
  client that goes away cancels it (a :class:`DisconnectWatch`, not
  Starlette's task group per stream, which cost a large share of the CPU per
  stream); the peer's connection is closed on the way out, which is how a node
  or an engine learns to abort. A peer failing mid-stream (its connection
  lost or silent) ends the stream with one error event and no ``[DONE]``; a
  peer's own error event and any ``[DONE]`` after it pass as sent. An event
  stream is passed on in whole events only, so that error event never lands
  inside a half-sent one. A client that stops reading
  holds its stream (and the peer's in-flight count) until the exchange's
  deadline, a second more, then the stream is cut; an owner that ended the
  request at the peer (an abort) cuts it sooner (:meth:`StallCut.cut_if_stalled`).
- :class:`WholeAnswer`: a buffered answer, sent in pieces of
  :data:`ANSWER_PIECE_BYTES` so that each waits while the client does not read
  (one write handed it all to the connection: its sender's count of it, a
  request in flight and its bytes, ended there, while the bytes the client did
  not take stayed in memory until it read them or left, uncounted and uncut).
  It ends, and runs ``on_close``, after its last piece; a client that stops
  reading is cut as a stream's is (the same :class:`StallCut`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Iterable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from handoff.protocol.sse import EVENT_ENDS, EventTooLarge, WholeEvents
from handoff.service.disconnect import DisconnectWatch
from handoff.service.errors import error_envelope
from handoff.service.upstream import ProtocolError, UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

STALLED_CLIENT_GRACE_S = 1.0  # past the exchange's deadline, a send still waiting on the client is given up
ANSWER_PIECE_BYTES = 256 * 1024  # a buffered answer's bytes handed to the connection at a time
RELAYED_RESPONSE_HEADERS = frozenset({b"content-type", b"content-encoding", b"cache-control", b"retry-after",
                                      b"x-request-id"})


def relayed_headers(upstream: UpstreamResponse, *, default_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """The peer's headers a client gets, as raw ASGI headers (``default_type`` if it sent no type)."""
    headers = [(name, value) for name, value in upstream.headers if name in RELAYED_RESPONSE_HEADERS]
    if default_type is not None and not any(name == b"content-type" for name, _ in headers):
        headers.append((b"content-type", default_type))
    return headers


def sse_error_event(error_type: str, message: str) -> bytes:
    return b"data: " + json.dumps(error_envelope(error_type, message)).encode() + b"\n\n"


class ChunkTransform:
    """Rewrites a relayed body on the way (the LB's PD logprob merging); the default passes bytes through."""

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def feed_pieces(self, chunk: bytes) -> Iterable[bytes]:
        """:meth:`feed`'s output, in pieces the relay sends one by one: a transform that makes much of little
        (a read of many events) hands out each as it is made, so the event loop has its turns between them and
        no more than a piece is held."""
        return (self.feed(chunk),)

    def finish(self) -> bytes:
        return b""


class StallCut(Response):
    """A response whose sends a client that stops reading may hold: :meth:`cut_if_stalled` (an owner's abort) and
    a timer past its deadline (:meth:`_arm_stall_timer`) cancel the task serving it while a send waits."""

    _task: asyncio.Task[object] | None = None
    _is_sending = False  # a send to the client is under way
    _num_sends = 0  # sends begun: one waiting since an earlier look is the same number
    _is_stalled = False  # ... and was given up past the deadline (or an abort)
    _stall_mark: tuple[int, float] | None = None  # the send seen waiting, and since when

    def cut_if_stalled(self) -> None:
        """Cut the response if one send has waited on the client for :data:`STALLED_CLIENT_GRACE_S` since an
        earlier call (called again and again by an owner that ended the request at the peer, an abort: the client,
        not the peer, holds it, and the peer's in-flight count with it)."""
        if not self._is_sending or self._task is None:
            self._stall_mark = None
            return
        now = asyncio.get_running_loop().time()
        if self._stall_mark is None or self._stall_mark[0] != self._num_sends:
            self._stall_mark = (self._num_sends, now)
        elif now - self._stall_mark[1] >= STALLED_CLIENT_GRACE_S:
            self._is_stalled = True
            self._task.cancel()

    async def _send(self, send: Send, message: dict) -> None:
        self._is_sending = True
        self._num_sends += 1
        await send(message)
        self._is_sending = False

    async def _send_body(self, send: Send, body: bytes, *, more_body: bool) -> None:
        await self._send(send, {"type": "http.response.body", "body": body, "more_body": more_body})

    def _arm_stall_timer(self, deadline: float | None) -> asyncio.TimerHandle | None:
        """Past ``deadline`` (and a grace), a send still waiting on the client cancels this response: a client
        that stops reading must not hold it, and the peer's in-flight count, for good."""
        if deadline is None:
            return None
        task = asyncio.current_task()

        def give_up() -> None:
            if self._is_sending and task is not None:
                self._is_stalled = True
                task.cancel()

        return asyncio.get_running_loop().call_at(deadline + STALLED_CLIENT_GRACE_S, give_up)


class WholeAnswer(StallCut):
    """``body``, read whole from a peer, sent with ``headers`` (``Content-Length`` among them) in pieces;
    ``on_close`` runs once after the last piece went to the connection or the client left or was cut
    (``deadline``: the exchange's, as a stream's)."""

    def __init__(self, body: bytes, *, status: int, headers: list[tuple[bytes, bytes]],
                 on_close: Callable[[], None] = lambda: None, deadline: float | None = None) -> None:
        self.status_code = status
        self.body = body
        self.raw_headers = headers
        self.background = None
        self._on_close = on_close
        self._deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._task = asyncio.current_task()
        stop_watch = self._arm_patient_cut(self._deadline)
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            body = self.body
            for start in range(0, max(len(body), 1), ANSWER_PIECE_BYTES):
                end = start + ANSWER_PIECE_BYTES
                await self._send_body(send, body[start:end], more_body=end < len(body))
        except asyncio.CancelledError:
            if not self._is_stalled:
                raise
            log.warning("a client stopped reading its answer; cut (past its deadline, or aborted)")
        finally:
            stop_watch()
            self._on_close()

    def _arm_patient_cut(self, deadline: float | None) -> Callable[[], None]:
        """Past ``deadline`` (and a grace), cut only a client that stopped reading: one send waiting a whole grace
        (:meth:`cut_if_stalled`, asked every half grace), not a send that waits on a client reading slowly (an
        answer read just before its deadline is still going out). Returns what stops the watch."""
        if deadline is None:
            return lambda: None
        loop = asyncio.get_running_loop()
        pending: list[asyncio.TimerHandle] = []

        def look() -> None:
            self.cut_if_stalled()
            pending[0] = loop.call_later(STALLED_CLIENT_GRACE_S / 2, look)

        pending.append(loop.call_at(deadline + STALLED_CLIENT_GRACE_S, look))
        return lambda: pending[0].cancel()


class StreamRelay(StallCut):
    """Streams ``upstream`` to the client as it arrives; owns the upstream (and ``watch``) from here on.

    ``on_failure(exc)`` turns a peer failing mid-stream into the final error
    event (and records it where the caller wants); ``on_close(is_disconnected)``
    runs once at the end, whatever happened (an in-flight lease is released
    there). ``watch``: the one the handler started, if any; else one is
    started here. ``head``: body bytes the caller already read off
    ``upstream``, relayed first as soon as the stream starts.
    """

    def __init__(self, upstream: UpstreamResponse, *, on_failure: Callable[[UpstreamError], bytes],
                 on_close: Callable[[bool], None], watch: DisconnectWatch | None = None,
                 transform: ChunkTransform | None = None, default_type: bytes | None = None,
                 head: bytes = b"") -> None:
        self.status_code = upstream.status
        self.raw_headers = relayed_headers(upstream, default_type=default_type)
        self.background = None
        self._upstream = upstream
        self._on_failure = on_failure
        self._on_close = on_close
        self._watch = watch
        self._head = head  # body bytes the caller already read off ``upstream``: relayed first, at once
        self._transform = transform or ChunkTransform()
        self._is_events = any(name == b"content-type" and value.startswith(b"text/event-stream")
                              for name, value in self.raw_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream, transform = self._upstream, self._transform
        self._task = asyncio.current_task()
        watch = self._watch or DisconnectWatch(receive, scope)
        stall_timer = self._arm_stall_timer(upstream.deadline)
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            hold = WholeEvents() if self._is_events else None  # the start of an event still coming
            chunk, self._head = self._head, b""
            while chunk or (chunk := await upstream.next_chunk()):
                pieces, chunk = transform.feed_pieces(chunk), b""
                for out in pieces:
                    if out and hold is not None and (hold.is_holding or not out.endswith(EVENT_ENDS)):
                        out = hold.feed(out)
                    if out:  # the hot path: the send written out, not through _send_body
                        self._is_sending = True
                        self._num_sends += 1
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        self._is_sending = False
            watch.finish()
            rest = hold.finish() if hold is not None else b""
            await self._send_body(send, rest + transform.finish(), more_body=False)
        except UpstreamError as exc:
            watch.finish()
            await self._send_body(send, self._on_failure(exc), more_body=False)
        except EventTooLarge as exc:  # the peer's stream, not ours: its failure, and its connection closed
            watch.finish()
            failure = ProtocolError(f"invalid event stream: {exc}", url=upstream.url)
            await self._send_body(send, self._on_failure(failure), more_body=False)
        except asyncio.CancelledError:
            if self._is_stalled:
                log.warning("a client of %s stopped reading its stream; cut (past its deadline, or aborted)",
                            upstream.url)
            elif not watch.is_disconnected:
                raise
            else:
                watch.absorb_cancel()
        finally:
            if stall_timer is not None:
                stall_timer.cancel()
            watch.stop()
            upstream.close()  # a stream cut short closes the peer's connection: the peer aborts
            self._on_close(watch.is_disconnected or self._is_stalled)

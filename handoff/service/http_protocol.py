"""uvicorn's HTTP/1.1 protocol as every handoff service runs it: :class:`ServiceProtocol`.

On top of :class:`~handoff.service.head_timeout.HeadTimeoutProtocol` (a
deadline on every request head), two things uvicorn does at a cost on every
request:

- **One write per answer.** uvicorn writes a response's head when the app
  sends ``http.response.start`` and its body when it sends
  ``http.response.body``: two ``send`` system calls and two packets for every
  buffered answer. Here the head is held until the first body write of the
  same event-loop turn and both go out together; a head with no body write in
  that turn (a stream whose first chunk is not in yet) goes out by itself at
  the end of the turn, so no client waits longer for it.
- **Heads httptools lets through, refused.** An HTTP/1.1 request without one
  ``Host`` (RFC 9112 3.2), a transfer coding other than ``chunked`` alone
  (httptools takes ``gzip, chunked`` as chunked and hands on the coded bytes),
  ``Transfer-Encoding`` in an HTTP/1.0 request (6.1), and an upgrade request
  (``Connection: upgrade`` with ``Upgrade``) that declares a body are the 400
  ``invalid_request`` envelope, the connection closed: httptools skips such a
  request's body, so its bytes were read as the next request (a request
  smuggled in a body) or dropped. No upgrade is ever taken: a bodiless upgrade
  request is answered and its connection closed, since what the client sent
  after it in the same read is lost. A version other than 1.0 and 1.1 (httptools
  reads ``HTTP/2.0``, and ``HTTP/0.9`` or a request line without one) is the 505
  ``http_version_not_supported`` envelope, the connection closed.
- **No chunked answer to HTTP/1.0.** uvicorn codes every answer without a
  ``Content-Length`` as chunked, which an HTTP/1.0 client (nginx's default
  ``proxy_http_version``, ``curl -0``) cannot read (RFC 9112 6.1): a stream to a
  1.0 request goes out as it is and ends with the close.
- **A bounded queue of pipelined requests.** uvicorn reads again after every
  answer, so a client pipelining requests while it reads the answers had a
  read's worth more queued (thousands of small GETs) per answer, without bound:
  while :data:`MAX_PIPELINED` wait, the connection is read no more.
- **A disconnect noticed without a task.** A request's scope carries a
  :class:`~handoff.service.disconnect.DisconnectNotice` that this protocol
  fires when the connection is lost, so a
  :class:`~handoff.service.disconnect.DisconnectWatch` needs no task parked on
  ``receive()`` per request (about 10 us of CPU each).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Message
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from handoff.protocol import errors as E
from handoff.service.disconnect import NOTICE_EXTENSION, DisconnectNotice
from handoff.service.head_timeout import HeadTimeoutProtocol

__all__ = ["MAX_PIPELINED", "ServiceProtocol", "head_refusal"]

MAX_PIPELINED = 100  # requests queued behind the one being answered before the connection is read no more


class _RefusedHead(Exception):
    """Raised from the parser's callback: httptools stops, and uvicorn answers through ``send_400_response``."""


def head_refusal(http_version: str, headers: list[tuple[bytes, bytes]], is_upgrade: bool) -> str | None:
    """Why a complete head (lower-case names) httptools accepted is refused; None when it is served. Values lose
    the trailing whitespace httptools keeps (RFC 9112 5: not part of the value), in place."""
    num_hosts, length = 0, b"0"
    codings: list[bytes] = []
    for index, (name, value) in enumerate(headers):
        if value[-1:] in (b" ", b"\t"):
            value = value.rstrip(b" \t")
            headers[index] = (name, value)
        if name == b"host":
            num_hosts += 1
        elif name == b"transfer-encoding":
            codings.append(value.strip(b" \t").lower())
        elif name == b"content-length":
            length = value
    if num_hosts > 1 or (num_hosts == 0 and http_version != "1.0"):
        return f"an HTTP/1.1 request needs exactly one Host header, got {num_hosts}"
    if codings and http_version == "1.0":
        return "Transfer-Encoding in an HTTP/1.0 request"
    if codings and codings != [b"chunked"]:
        return "the only transfer coding served is chunked, alone"
    if is_upgrade and (codings or length.strip(b"0")):
        return "an upgrade request (Connection: upgrade) with a body: no upgrade is served, send it without"
    return None


class _HeadWithBody:
    """The transport of one request's response cycle: holds its first write until the second or the end of
    the loop turn, whichever comes first; anything else goes to the real transport."""

    __slots__ = ("_transport", "_loop", "_held", "_has_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._has_held = False

    def write(self, data: bytes) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held + data)
        elif not self._has_held:
            self._has_held = True
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():  # a client gone meanwhile gets nothing
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Http10Cycle(RequestResponseCycle):
    """The response cycle of an HTTP/1.0 request, which uvicorn never keeps alive: an answer with no
    ``Content-Length`` is sent close-delimited (RFC 9112 6.1: no transfer coding to a 1.0 client), never chunked;
    a ``Transfer-Encoding`` the app names is dropped."""

    _is_close_delimited = False

    async def send(self, message: Message) -> None:  # type: ignore[override]
        if message["type"] == "http.response.start" and not self.response_started:
            headers = [(name, value) for name, value in message.get("headers", ())
                       if name.lower() != b"transfer-encoding"]
            if self.scope["method"] != "HEAD" and message["status"] not in (204, 304) \
                    and not any(name.lower() == b"content-length" for name, _ in headers):
                self._is_close_delimited = True
                self.keep_alive = False  # the close ends the body
                self.chunked_encoding = False  # uvicorn's send adds no Transfer-Encoding
            message = {**message, "headers": headers}
        elif self._is_close_delimited and message["type"] == "http.response.body":
            self.expected_content_length = len(message.get("body", b""))  # uvicorn's count of what is left ends at 0
        await super().send(message)  # type: ignore[arg-type]


class ServiceProtocol(HeadTimeoutProtocol):
    """:class:`HeadTimeoutProtocol` whose response cycles write a head and the first body bytes together and
    whose requests are told when their connection is lost."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._notices: list[tuple[RequestResponseCycle, DisconnectNotice]] = []  # requests not answered yet

    def on_headers_complete(self) -> None:
        is_upgrade = self.parser.should_upgrade()
        version = self.parser.get_http_version()
        if not self._is_discarding:
            if version != "1.1" and version != "1.0":
                self._is_head_pending = False
                self._bad_request_kind = E.HTTP_VERSION_NOT_SUPPORTED
                self._bad_request_reason = f"HTTP/{version} is not served (a request line without a version is " \
                    "HTTP/0.9): send HTTP/1.1"
                raise _RefusedHead(self._bad_request_reason)
            reason = head_refusal(version, self.headers, is_upgrade)
            if reason is not None:
                self._is_head_pending = False
                self._bad_request_reason = reason
                raise _RefusedHead(reason)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.transport is not self.transport:  # no new request (refused, or upgraded)
            return
        if is_upgrade:  # not taken: httptools dropped the rest of the read, so nothing after it is answered
            cycle.keep_alive = False
        if version == "1.0":
            cycle.__class__ = _Http10Cycle  # before its task first runs: its send is looked up then
        cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
        notice = DisconnectNotice(on_watch=self._resume_reading)
        cycle.scope.setdefault("extensions", {})[NOTICE_EXTENSION] = notice  # type: ignore[typeddict-item]
        self._notices = [(c, n) for c, n in self._notices if not c.response_complete]
        self._notices.append((cycle, notice))

    def _resume_reading(self) -> None:
        """Read again (uvicorn pauses reading while a body waits for the app): a closed connection is only seen
        while reading."""
        if self.flow is not None and not self.transport.is_closing() and len(self.pipeline) < MAX_PIPELINED:
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn reads again after every answer: with requests still queued, a client pipelining while it reads
        # its answers would add a read's worth (up to 256 KiB of requests) per answer, without bound
        if self.flow is not None and len(self.pipeline) >= MAX_PIPELINED:
            self.flow.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        notices, self._notices = self._notices, []
        super().connection_lost(exc)
        for cycle, notice in notices:
            if not cycle.response_complete:
                notice.lost()

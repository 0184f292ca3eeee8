"""uvicorn's HTTP/1.1 protocol with a deadline and a size bound on every request head.

uvicorn bounds the time between two requests of a kept-alive connection and nothing else: a connection that never
sends a byte, or sends its head one byte a minute, stays open for good (thirty such connections were held
indefinitely). Here the head (request line and headers) must be complete within ``head_timeout_s`` of the
connection's opening or of the request's first byte; if not, the client gets a 408 and the connection is closed. A
head that starts while the previous answer on the connection is still going out (pipelined) has the same deadline;
past it, the 408 follows that answer. The body has its own deadline (:mod:`handoff.service.limits`).

A head is also bounded in size (``MAX_HEAD_BYTES``): uvicorn's httptools protocol keeps the URL and every header
line it is sent, with no limit of its own, so one client sending header lines as fast as loopback carries them grew
a process by 2 GiB in 3 s, well within the deadline. Past the bound the client gets a 431 ``head_too_large`` and the
connection is closed. The bytes are counted as they arrive, so a process holds at most the bound and one read more
of a head; one that arrived whole in a read or two is measured before it runs.

A chunked body's trailer fields are dropped, never added to the request's headers (uvicorn appends them to the list
the app reads as headers, so a trailer could override a header the LB passes on to a node: its content type, request
id or weight-version pin), and they are bounded as a head is: uvicorn kept every trailer line, with no bound of its
own and past the head's deadline, so one client grew a process by 2 GiB in 3 s. Past ``MAX_HEAD_BYTES`` of trailers
(a read more at most) the connection is closed.

A request that is not HTTP/1.1 as httptools reads it (Content-Length with Transfer-Encoding, two Content-Lengths, a
coding other than ``chunked``, a folded header line, a control character in a value) is a 400 ``invalid_request``
envelope and the connection closed, as every other error of these services; when it follows a request whose answer
is still to go out (pipelined), the 400 waits for that answer (uvicorn wrote it at once, so the client read it as
the answer to its earlier request) and nothing after it is read.

The open connections are bounded too (``max_connections``, ``--max-connections``): uvicorn takes any number, so a
client that kept as many idle keep-alive connections (or dribbled heads) as the process may open files made every
other client's connection reset and left no descriptor for the connections to the nodes or the engine. Past the
bound, a new connection closes the oldest one that has no request in progress (idle between requests, or still
sending its head); a connection whose next request already arrived, unread yet (a busy loop reads it a turn later),
has one in progress: closed, its client would get a reset for a request it sent (a POST no client may retry). When
every connection has a request in progress, the new one is answered 503 ``overloaded`` with ``Retry-After`` and
closed.
"""

from __future__ import annotations

import asyncio
import fcntl
import heapq
import itertools
import json
import logging
import resource
import struct
import termios
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from handoff.protocol import errors as E
from handoff.service.errors import HeadTooLarge, InvalidRequest, RequestTimeout, Unavailable

log = logging.getLogger(__name__)

DEFAULT_HEAD_TIMEOUT_S = 30.0
LINGER_S = 2.0  # how long a connection answered while its client still sends stays open to drop what comes
MAX_HEAD_BYTES = 64 * 1024  # a request line and its headers (nginx takes 4 x 8 KiB by default, uvicorn's h11 16 KiB)
_FDS_KEPT = 128  # descriptors left for files, listeners and the process's own use


def default_max_connections() -> int:
    """Half the descriptors this process may open, less a reserve: each client connection may need one more
    to a peer (the LB's to a node, the sidecar's to its engine)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, (soft - _FDS_KEPT) // 2)


def head_size(method: bytes, url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """A complete head's bytes as a client writes it without optional whitespace: its request line and each
    ``name: value`` line, CRLF-terminated, and the blank line that ends it."""
    return len(method) + len(url) + len(b"  HTTP/1.1\r\n") + sum(len(n) + len(v) + 4 for n, v in headers) + 2


_opened = itertools.count()


class HeadTimeoutProtocol(HttpToolsProtocol):
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    max_connections: int | None = None
    _bad_request_kind: E.ErrorType = E.INVALID_REQUEST  # the answer to a refused request (with its reason)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._is_head_pending = False  # a request head began and is not complete
        self._is_head_overdue = False  # ... and its deadline passed while an answer was going out: 408 after it
        self._head_bytes = 0  # bytes received since the current head began (more once its body streams: unused)
        self._read_bytes = self._head_read_bytes = 0  # the last read's size; that of the read the head began in
        self._is_discarding = False  # answered and closing: what the client still sends is dropped unread
        self._is_in_body = False  # the current request's head is complete: a header field now is a trailer
        self._is_after_chunk_header = False  # a chunk's size line was read and none of its data yet
        self._trailer_bytes = 0  # bytes since then: the last chunk's trailers (a chunk's data resets it)
        self._is_400_pending = False  # a malformed request came while answers were still to go out: 400 after them
        self._bad_request_reason = "the request is not valid HTTP/1.1 (its framing or a header line)"
        self._number = next(_opened)

    @classmethod
    def with_timeout(cls, head_timeout_s: float, max_connections: int | None = None) -> type[HeadTimeoutProtocol]:
        """This protocol with its own deadline (and bound on open connections), as uvicorn's ``http=`` wants
        a class."""
        return type(cls.__name__, (cls,), {"head_timeout_s": head_timeout_s, "max_connections": max_connections})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections \
                and not self._close_oldest_idle():
            error = Unavailable(f"this process has {self.max_connections} connections open, each with a request "
                                "in progress (--max-connections); try again shortly",
                                type=E.OVERLOADED.name, retry_after=1)
            self._write_error(503, b"Service Unavailable", error, retry_after=1)
            return
        self._arm_head_timer()

    @property
    def _is_idle(self) -> bool:
        """No request in progress: between two requests, or its head still arriving."""
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline \
            and not self.transport.is_closing()

    def _has_unread_bytes(self) -> bool:
        """Bytes arrived that this protocol has not seen yet (a request the loop reads a turn later)."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            pending = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):  # a socket closed meanwhile, or no descriptor: nothing can come from it
            return False
        return struct.unpack("i", pending)[0] > 0

    def _oldest_idle(self) -> HeadTimeoutProtocol | None:
        """The oldest other connection with no request in progress, nor one arrived unread."""
        idle = [(c._number, c) for c in self.connections
                if c is not self and isinstance(c, HeadTimeoutProtocol) and c._is_idle]
        heapq.heapify(idle)  # oldest first, without sorting them all: the first one almost always fits
        while idle:
            _, oldest = heapq.heappop(idle)
            if not oldest._has_unread_bytes():
                return oldest
        return None

    def _close_oldest_idle(self) -> bool:
        """Close the oldest other connection with no request in progress; False when there is none."""
        oldest = self._oldest_idle()
        if oldest is None:
            return False
        log.debug("%d connections open (--max-connections %d): the oldest idle one closed",
                  len(self.connections), self.max_connections)
        oldest.transport.close()
        oldest.connections.discard(oldest)  # counted out now; connection_lost discards it again
        return True

    def data_received(self, data: bytes) -> None:
        if self._is_discarding:
            return
        self._head_bytes += len(data)
        self._read_bytes = len(data)
        if self._is_after_chunk_header:
            self._trailer_bytes += len(data)
        super().data_received(data)
        if self._is_head_pending and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._head_too_large()
        elif self._is_after_chunk_header and self._trailer_bytes > MAX_HEAD_BYTES \
                and not self.transport.is_closing():
            log.debug("a request's trailers passed %d bytes: its connection closed", MAX_HEAD_BYTES)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes httptools refuses: the envelope, after any answer still to go out."""
        self._is_discarding = True  # the stream's framing is lost: nothing after the bad request is read
        cycle = self.cycle
        if cycle is None or cycle.response_complete \
                or (self._is_in_body and not self.pipeline and not cycle.response_started):
            if cycle is not None and not cycle.response_complete:  # its handler waits for the body: it is gone
                cycle.disconnected = True
                cycle.message_event.set()
            self._write_bad_request()
        elif self._is_in_body:
            self.transport.close()  # the bad body of a request whose answer (or an earlier one's) is going out
        else:
            self._is_400_pending = True  # the head of a request after one still being answered

    def _write_bad_request(self) -> None:
        self._is_400_pending = False
        self._disarm_head_timer()  # its 408 would follow the 400 on a connection whose write side is shut
        kind = self._bad_request_kind
        error = InvalidRequest(self._bad_request_reason, kind=kind)
        self._write_error(kind.status, HTTPStatus(kind.status).phrase.encode(), error, linger=True)

    def on_chunk_header(self) -> None:
        self._is_after_chunk_header = True

    def on_body(self, body: bytes) -> None:
        self._is_after_chunk_header = False
        self._trailer_bytes = 0
        if not self._is_discarding:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._is_in_body = self._is_after_chunk_header = False
        if not self._is_discarding:
            super().on_message_complete()

    def _head_too_large(self) -> None:
        self._disarm_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined head under an answer still going out: no room for a 431
            return
        self._write_error(431, b"Request Header Fields Too Large",
                          HeadTooLarge(f"the request head is larger than {MAX_HEAD_BYTES} bytes"), linger=True)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._is_discarding:
            return  # a request pipelined behind a refused head, in the same read: no deadline, never answered
        self._is_head_pending = True
        self._is_in_body = self._is_after_chunk_header = False
        self._trailer_bytes = 0
        self._head_bytes = 0  # the bytes of this head in the read that began it are not counted: one read at most
        self._head_read_bytes = self._read_bytes
        if self._head_timer is None:  # a kept-alive connection's next request: its head starts now
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._is_head_pending = self._is_head_overdue = False
        self._head_bytes = 0
        self._disarm_head_timer()
        if self._is_discarding:
            return  # a request after one refused on this connection: never run
        if self._head_read_bytes + self._head_bytes > MAX_HEAD_BYTES \
                and head_size(self.parser.get_method(), self.url, self.headers) > MAX_HEAD_BYTES:
            # complete in the read that passed the bound (or in the one that began it): refused all the same
            # (measured only when the reads it came in could hold that much: a few µs a request otherwise)
            self._head_too_large()
            self._is_discarding = True  # what the parser still reads of this read (a body) is dropped
            return
        super().on_headers_complete()
        self._is_in_body = True
        # uvicorn adds a trailer to the list the scope holds as the headers: a new list takes them, never read
        self.headers = []

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._is_400_pending:
            if not self.pipeline and self.cycle.response_complete and not self.transport.is_closing():
                self._write_bad_request()
        elif self._is_head_overdue:  # the next head's deadline passed while this answer went out
            self._head_timed_out()
        elif not self._is_head_pending:
            self._disarm_head_timer()  # the keep-alive timer watches the idle time until the next request

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # an answer is going out: 408 after it
            self._is_head_overdue = self._is_head_pending
            return
        error = RequestTimeout(f"the request head did not arrive within {self.head_timeout_s:g} s")
        self._write_error(408, b"Request Timeout", error)

    def _write_error(self, status: int, reason: bytes, error: Any, retry_after: int | None = None,
                     linger: bool = False) -> None:
        """Answer ``error`` and close. ``linger``: for a client still sending (a head past its bound), whose
        kernel would drop the answer unread if the close found its bytes unread here (a reset): the write side
        is shut at once, what comes is dropped, and the connection closes after ``LINGER_S`` or the client's
        close, whichever is first."""
        body = json.dumps(error.envelope()).encode()
        extra = b"retry-after: %d\r\n" % retry_after if retry_after is not None else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n%s\r\n%s" % (status, reason, len(body), extra, body))
        if not linger or not self.transport.can_write_eof():
            self.transport.close()
            return
        self._is_discarding = True
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

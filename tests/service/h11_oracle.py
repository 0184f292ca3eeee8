"""What a conformant client makes of a response byte stream: h11's answer, plus our deliberate rules.

:func:`expected` feeds the stream to an ``h11.Connection`` (client role, no
buffer limit) and turns its events into an :class:`Outcome`. Where
:class:`~handoff.service.http1_parser.ResponseParser` deliberately differs
from h11, the rule is applied here, explicitly:

1. a head (interim or final) longer than ``max_head_bytes`` or with more than
   ``max_fields`` field lines, a chunk-size line longer than ``max_head_bytes``,
   or a trailer section past either cap: rejected (h11 has no such caps);
2. a final status of 600 or more: rejected (h11 takes 200-999);
3. Content-Length with chunked Transfer-Encoding on a response that has a
   body: rejected (h11 lets chunked win);
4. bytes after a complete response: the response stands, the connection is not
   reused (h11 keeps the bytes for a next cycle; neither reuses them here);
5. more than ``MAX_INTERIM_RESPONSES`` interim responses: rejected (h11 skips
   any number).

An incomplete framing section longer than the cap (a head that never ends)
may be rejected before the peer closes: :attr:`Outcome.may_reject_early`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import h11

MAX_HEAD_BYTES = 64 * 1024
MAX_FIELDS = 100
MAX_INTERIM_RESPONSES = 16


@dataclass(frozen=True)
class Outcome:
    """``kind``: ``complete``; ``incomplete`` (more bytes needed, the peer did not close); ``reject``.

    For ``reject``, ``is_at_eof`` says the stream was only judged bad when the peer
    closed (a dropped connection to our client) rather than by its bytes (a
    protocol error).
    """

    kind: str
    status: int | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    is_reusable: bool = False
    is_at_eof: bool = False
    may_reject_early: bool = False
    why: str = field(default="", compare=False)


def expected(stream: bytes, *, is_eof: bool, method: bytes = b"GET") -> Outcome:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 40)
    conn.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"peer")]))
    conn.send(h11.EndOfMessage())
    if stream:  # h11 takes b"" for the peer's close
        conn.receive_data(stream)
    reader = _Reader(conn, stream, method)
    try:
        return reader.run(is_eof)
    except h11.RemoteProtocolError as exc:
        return reader.reject(f"h11: {exc}", is_at_eof=reader.is_eof_fed)


class _Reader:
    def __init__(self, conn: h11.Connection, stream: bytes, method: bytes) -> None:
        self.conn = conn
        self.stream = stream
        self.method = method
        self.offset = 0
        self.is_eof_fed = False
        self.status: int | None = None
        self.headers: tuple[tuple[bytes, bytes], ...] = ()
        self.body: list[bytes] = []
        self.is_chunked = False
        self.is_footer_pending = False  # h11 discards a chunk's CRLF at the start of the next event
        self.num_interim = 0

    def reject(self, why: str, *, is_at_eof: bool = False) -> Outcome:
        return Outcome("reject", is_at_eof=is_at_eof, may_reject_early=self._is_remainder_over_cap(), why=why)

    def _is_remainder_over_cap(self) -> bool:
        return len(self.stream) - self.offset > MAX_HEAD_BYTES

    def run(self, is_eof: bool) -> Outcome:
        while True:
            before = len(self.conn.trailing_data[0])
            event = self.conn.next_event()
            raw = self.stream[self.offset:self.offset + before - len(self.conn.trailing_data[0])]
            self.offset += len(raw)
            if event is h11.NEED_DATA:
                if not is_eof or self.is_eof_fed:
                    return Outcome("incomplete", self.status, self.headers, b"".join(self.body),
                                   may_reject_early=self._is_remainder_over_cap())
                self.conn.receive_data(b"")
                self.is_eof_fed = True
                continue
            if isinstance(event, h11.InformationalResponse):
                if (why := _head_over_caps(raw)) is not None:
                    return self.reject(why)
                self.num_interim += 1
                if self.num_interim > MAX_INTERIM_RESPONSES:
                    return self.reject("too many interim responses")
            elif isinstance(event, h11.Response):
                if (why := self._final_head_rule(event, raw)) is not None:
                    return self.reject(why)
            elif isinstance(event, h11.Data):
                if self.is_chunked and event.chunk_start:
                    line_bytes = len(raw) - len(event.data) - (2 if self.is_footer_pending else 0)
                    if line_bytes > MAX_HEAD_BYTES:
                        return self.reject("chunk-size line over the cap")
                self.is_footer_pending = event.chunk_end
                self.body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                if self.is_chunked and (why := self._trailer_rule(raw)) is not None:
                    return self.reject(why)
                trailing, _ = self.conn.trailing_data
                is_reusable = self.conn.their_state is h11.DONE and not trailing and not is_eof
                return Outcome("complete", self.status, self.headers, b"".join(self.body), is_reusable)
            else:
                raise AssertionError(f"unexpected h11 event {event!r}")

    def _final_head_rule(self, event: h11.Response, raw: bytes) -> str | None:
        if (why := _head_over_caps(raw)) is not None:
            return why
        if event.status_code >= 600:
            return f"status {event.status_code}"
        names = {name for name, _ in event.headers}
        has_body = event.status_code not in (204, 304) and self.method != b"HEAD"
        if has_body and b"transfer-encoding" in names and b"content-length" in names:
            return "Content-Length with Transfer-Encoding"
        self.status = event.status_code
        self.headers = tuple((bytes(name), bytes(value)) for name, value in event.headers)
        self.is_chunked = has_body and b"transfer-encoding" in names
        return None

    def _trailer_rule(self, raw: bytes) -> str | None:
        section = raw[2:] if self.is_footer_pending else raw
        line_end = section.index(b"\r\n") + 2
        if line_end > MAX_HEAD_BYTES:
            return "last chunk-size line over the cap"
        trailers = section[line_end:]
        if trailers in (b"\n", b"\r\n"):
            return None
        if len(trailers) > MAX_HEAD_BYTES or _num_field_lines(trailers, first=0) > MAX_FIELDS:
            return "trailers over the cap"
        return None


def _head_over_caps(raw: bytes) -> str | None:
    if len(raw) > MAX_HEAD_BYTES:
        return f"head of {len(raw)} bytes"
    if _num_field_lines(raw, first=1) > MAX_FIELDS:
        return "too many header fields"
    return None


def _num_field_lines(section: bytes, *, first: int) -> int:
    """Field lines of a head or trailer section ending in its blank line, obs-fold lines joined."""
    lines = section.split(b"\n")[first:-2]
    return sum(1 for line in lines if not line.startswith((b" ", b"\t")))

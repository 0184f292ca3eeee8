"""An HTTP/1.1 response parser (RFC 9112) that never trusts its peer: sans-IO, bounded, h11's rules.

:class:`ResponseParser` is fed the bytes of one exchange in whatever pieces
they arrive and reads one response: interim 1xx responses are skipped, the
final head is parsed, the body is framed by Content-Length, chunked coding or
the connection's close. Body bytes go to the ``sink`` deque as they are framed.

The rules are h11's (``h11/_readers.py``, ``_headers.py``, ``_abnf.py``), so the
differential fuzz test (``tests/service/test_http1_fuzz.py``) holds the two to
the same answers. Where this parser deliberately differs:

- every head (interim, final) and the trailer section is at most
  ``max_head_bytes`` with at most ``max_fields`` fields, and a chunk-size line
  is at most ``max_head_bytes``: a peer sending endless header lines costs
  bounded memory (h11 only bounds what sits unparsed in its buffer);
- statuses outside 100-599 and 101 (no upgrade is ever asked for) are errors;
- more than ``MAX_INTERIM_RESPONSES`` interim responses before the final one
  are an error: a peer sending them without end is cut off at once, not at the
  request's deadline (h11 skips any number);
- Content-Length together with Transfer-Encoding is an error (RFC 9112 6.3:
  "ought to be handled as an error"; h11 lets chunked win);
- bytes after the response are never parsed: :attr:`has_trailing_bytes` tells
  the connection to close (h11 keeps them for a next cycle).

Trailers are validated and dropped: they never reach, let alone override, the
response's headers. Content codings are not touched (a gzip body stays gzip).
"""

from __future__ import annotations

import re
from collections import deque

from handoff.service.http1_fields import (
    Fields,
    Framing,
    MalformedResponse,
    parse_fields,
    parse_head,
    section_lines,
)

__all__ = ["DEFAULT_MAX_FIELDS", "DEFAULT_MAX_HEAD_BYTES", "MAX_INTERIM_RESPONSES", "MalformedResponse",
           "ResponseParser"]

DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_MAX_FIELDS = 100
MAX_INTERIM_RESPONSES = 16  # 100 Continue and 103 Early Hints come one or a few at a time

_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_BLANK_LINE = re.compile(rb"\n\r?\n")
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_NO_BODY_STATUSES = frozenset({204, 304})


class Phase:
    """What the parser reads next. Plain string constants, compared with ``is``: the parser reads its phase several
    times per piece of every answer, and Python 3.11 reads an enum member through the enum metaclass's
    ``__getattr__`` hook, about 115 ns against 25 ns for a class attribute (2% of the LB's CPU per fan-out,
    ``docs/benchmarks.md``)."""

    HEAD = "head"                # a status line and fields (interim or final)
    LENGTH = "length"            # Content-Length body bytes
    CHUNK_LINE = "chunk-size line"
    CHUNK_DATA = "chunk data"
    CHUNK_END = "chunk end"      # the CRLF after a chunk's data
    TRAILERS = "trailer section"
    UNTIL_CLOSE = "until close"  # no framing: the body ends when the peer closes
    DONE = "done"
    FAILED = "failed"


class ResponseParser:
    """Reads one response to a request (``is_head_request`` for HEAD, whose response has no body).

    After :meth:`feed`: :attr:`is_head_done` once the final head is in
    (:attr:`status`, :attr:`headers`: lower-case names, values as sent but
    h11's normalised Content-Length and Transfer-Encoding), :attr:`is_done` at
    the end of the body, :attr:`is_keep_alive` whether the connection may carry
    another exchange. Errors raise :class:`MalformedResponse` and end the parse.
    """

    __slots__ = ("sink", "status", "http_version", "headers", "is_head_done", "is_keep_alive",
                 "has_trailing_bytes", "_phase", "_pending", "_search_from", "_remaining",
                 "_num_chunk_end_bytes", "_is_head_request", "_max_head_bytes", "_max_fields", "_num_interim")

    def __init__(self, sink: deque[bytes], *, is_head_request: bool = False,
                 max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES, max_fields: int = DEFAULT_MAX_FIELDS) -> None:
        self.sink = sink
        self.status = 0
        self.http_version = b""
        self.headers: Fields = []
        self.is_head_done = False
        self.is_keep_alive = False
        self.has_trailing_bytes = False
        self._phase = Phase.HEAD
        self._pending = bytearray()  # the start of a framing element (a head, a chunk line) still incomplete
        self._search_from = 0        # where in it to look for its end again
        self._remaining = 0          # body bytes left in the Content-Length or the chunk
        self._num_chunk_end_bytes = 0
        self._is_head_request = is_head_request
        self._max_head_bytes = max_head_bytes
        self._max_fields = max_fields
        self._num_interim = 0

    @property
    def is_done(self) -> bool:
        return self._phase is Phase.DONE

    def feed(self, data: bytes) -> int:
        """Parse ``data``; returns how many body bytes went to ``sink``."""
        if self._phase is Phase.DONE:
            self.has_trailing_bytes = self.has_trailing_bytes or bool(data)
            return 0
        if self._phase is Phase.FAILED:
            raise MalformedResponse("the response was already rejected")
        try:
            return self._feed(data)
        except MalformedResponse:
            self._phase = Phase.FAILED
            raise

    def feed_eof(self) -> bool:
        """The peer closed its side; True when that completed the response (a body read until close)."""
        if self._phase is Phase.UNTIL_CLOSE:
            self._phase = Phase.DONE
        return self._phase is Phase.DONE

    # -- the loop over phases ------------------------------------------------
    def _feed(self, data: bytes) -> int:
        if self._pending:
            self._pending += data
            buf: bytes | bytearray = self._pending
        else:
            buf = data
        pos, end, num_body = 0, len(buf), 0
        while pos < end:
            phase = self._phase
            if phase is Phase.LENGTH or phase is Phase.CHUNK_DATA or phase is Phase.UNTIL_CLOSE:
                take = end - pos if phase is Phase.UNTIL_CLOSE else min(self._remaining, end - pos)
                self.sink.append(buf if take == end and buf is data else bytes(buf[pos:pos + take]))
                num_body += take
                pos += take
                if phase is not Phase.UNTIL_CLOSE:
                    self._remaining -= take
                    if not self._remaining:
                        self._phase = Phase.DONE if phase is Phase.LENGTH else Phase.CHUNK_END
                continue
            if phase is Phase.CHUNK_LINE:
                pos, num_whole = self._read_whole_chunks(buf, pos)
                num_body += num_whole
                if pos == end:
                    break
            new_pos = self._read_framing(phase, buf, pos)
            if new_pos is None:  # an incomplete element: keep its bytes for the next piece
                if buf is not self._pending:
                    self._pending = bytearray(buf[pos:])
                elif pos:
                    del self._pending[:pos]
                self._search_from -= pos
                return num_body
            pos = new_pos
        if buf is self._pending:
            self._pending = bytearray()
        return num_body

    def _read_framing(self, phase: str, buf: bytes | bytearray, pos: int) -> int | None:
        """The element at ``pos`` read; its end, or None when more bytes are needed."""
        if phase is Phase.HEAD:
            return self._read_head(buf, pos)
        if phase is Phase.CHUNK_LINE:
            return self._read_chunk_line(buf, pos)
        if phase is Phase.CHUNK_END:
            return self._read_chunk_end(buf, pos)
        if phase is Phase.TRAILERS:
            return self._read_trailers(buf, pos)
        self.has_trailing_bytes = True  # DONE: bytes after the response
        return len(buf)

    def _need_more(self, buf: bytes | bytearray, pos: int, search_from: int) -> None:
        """An element starting at ``pos`` has no end yet: past the cap it never will."""
        if len(buf) - pos > self._max_head_bytes:
            raise MalformedResponse(f"{self._phase} longer than {self._max_head_bytes} bytes")
        self._search_from = max(search_from, pos)

    def _check_size(self, size: int) -> None:
        if size > self._max_head_bytes:
            raise MalformedResponse(f"{self._phase} longer than {self._max_head_bytes} bytes")
        self._search_from = 0

    # -- heads ---------------------------------------------------------------
    def _section_end(self, buf: bytes | bytearray, pos: int) -> int | None:
        """The end of the section at ``pos``, after its blank line (h11's ``maybe_extract_lines``); None when
        more bytes are needed."""
        if buf[pos:pos + 1] == b"\n":
            return pos + 1
        if buf[pos:pos + 2] == b"\r\n":
            return pos + 2
        match = _BLANK_LINE.search(buf, max(pos, self._search_from))
        if match is None:
            self._need_more(buf, pos, len(buf) - 2)
            return None
        end = match.end()
        self._check_size(end - pos)
        return end

    def _read_trailers(self, buf: bytes | bytearray, pos: int) -> int | None:
        end = self._section_end(buf, pos)
        if end is not None:
            parse_fields(section_lines(bytes(buf[pos:end])), self._max_fields)  # validated like headers, dropped
            self._phase = Phase.DONE
        return end

    def _read_head(self, buf: bytes | bytearray, pos: int) -> int | None:
        end = self._section_end(buf, pos)
        if end is None:
            if buf[pos] < 0x21:  # as h11: no status line starts with a control byte or a space
                raise MalformedResponse("the response does not start with a status line")
            return None
        head = parse_head(bytes(buf[pos:end]), self._max_fields)
        if head.status >= 200:
            self.status, self.http_version, self.headers = head.status, head.version, list(head.fields)
            self.is_head_done = True
            self._start_body(head.framing)
        else:
            self._num_interim += 1
            if self._num_interim > MAX_INTERIM_RESPONSES:
                raise MalformedResponse(f"more than {MAX_INTERIM_RESPONSES} interim (1xx) responses")
        return end  # after an interim response: the next head, its fields dropped with it

    def _start_body(self, framing: Framing) -> None:
        length, is_chunked, is_close = framing
        self.is_keep_alive = not is_close and self.http_version >= b"1.1"
        if self.status in _NO_BODY_STATUSES or self._is_head_request:
            self._phase = Phase.DONE
        elif is_chunked:
            if length is not None:
                raise MalformedResponse("both Content-Length and Transfer-Encoding")
            self._phase = Phase.CHUNK_LINE
        elif length is not None:
            self._remaining = length
            self._phase = Phase.LENGTH if length else Phase.DONE
        else:
            self.is_keep_alive = False
            self._phase = Phase.UNTIL_CLOSE

    # -- chunked coding --------------------------------------------------------
    def _read_whole_chunks(self, buf: bytes | bytearray, pos: int) -> tuple[int, int]:
        """Complete chunks with a bare size line, in one loop: a stream's events mostly arrive whole.

        Stops where the careful path must go on: a partial chunk, extensions,
        anything odd, the last chunk. Returns (new position, body bytes).
        """
        pieces = []
        end = len(buf)
        while True:
            at = buf.find(b"\r\n", pos, pos + 22)  # at most 20 hex digits, as h11 allows
            if at <= pos or buf[pos:at].strip(_HEX_DIGITS):
                break
            data_end = at + 2 + int(buf[pos:at], 16)
            if data_end == at + 2 or data_end + 2 > end or buf[data_end:data_end + 2] != b"\r\n":
                break
            pieces.append(buf[at + 2:data_end])
            pos = data_end + 2
        if not pieces:
            return pos, 0
        self._search_from = 0  # a size line left partial by an earlier read was finished here
        body = b"".join(pieces)
        self.sink.append(body)
        return pos, len(body)

    def _read_chunk_line(self, buf: bytes | bytearray, pos: int) -> int | None:
        at = buf.find(b"\r\n", max(pos, self._search_from))
        if at < 0:
            self._need_more(buf, pos, len(buf) - 1)
            return None
        end = at + 2
        self._check_size(end - pos)
        match = _CHUNK_LINE.fullmatch(buf, pos, end)
        if match is None:
            raise MalformedResponse(f"bad chunk-size line {bytes(buf[pos:min(end, pos + 80)])!r}")
        self._remaining = int(match[1], 16)
        self._phase = Phase.CHUNK_DATA if self._remaining else Phase.TRAILERS
        return end

    def _read_chunk_end(self, buf: bytes | bytearray, pos: int) -> int:
        expected = b"\r\n"[self._num_chunk_end_bytes:]
        got = bytes(buf[pos:pos + len(expected)])
        if got != expected[:len(got)]:
            raise MalformedResponse(f"chunk data not followed by CRLF: {got!r}")
        self._num_chunk_end_bytes += len(got)
        if self._num_chunk_end_bytes == 2:
            self._num_chunk_end_bytes = 0
            self._phase = Phase.CHUNK_LINE
        return pos + len(got)

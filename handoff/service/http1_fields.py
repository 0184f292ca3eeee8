"""Status lines and header fields of HTTP/1.1 responses, by h11's rules (``h11/_abnf.py``, ``_headers.py``).

Used by :class:`~handoff.service.http1_parser.ResponseParser` on every head
and trailer section it reads. A field line is ``token ":" OWS value OWS`` where
the value holds no NUL and no whitespace but SP and HTAB between its visible
characters; obs-fold continuation lines are joined with one space (RFC 9112
5.2). Content-Length must be digits, one value however often repeated;
Transfer-Encoding must be exactly ``chunked``, once.

A head is a pure function of its bytes, and the heads a client sees repeat
(the nodes of a fan-out answer alike; one node answers alike call after call),
so :func:`parse_head` keeps the last :data:`HEAD_CACHE_ENTRIES` parsed heads of
at most :data:`MAX_CACHED_HEAD_BYTES` each: a peer sending distinct heads costs
a bounded amount of memory, and a head that fails is parsed (and fails) again.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VCHAR = rb"[^\x00\s]"
# h11's field value, ``vchar+ ([ \t]+ vchar+)*`` between optional SP/HTAB, is the line after its first colon,
# stripped of SP/HTAB, holding none of the other whitespace bytes or NUL (checked by deleting them, a C loop
# several times faster than a pattern)
_NOT_IN_FIELD_VALUE = b"\x00\n\v\f\r"
_STATUS_LINE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|" + _FIELD_VCHAR + rb")*)?")
_FOLD_STARTS = (b" ", b"\t")
_DIGITS = re.compile(rb"[0-9]{1,20}")

Fields = list[tuple[bytes, bytes]]

HEAD_CACHE_ENTRIES = 256
MAX_CACHED_HEAD_BYTES = 4096


class MalformedResponse(Exception):
    """The bytes are not a valid HTTP/1.1 response, or pass a cap."""


class Framing(NamedTuple):
    """What a final head's fields say about its body and its connection."""

    content_length: int | None
    is_chunked: bool
    is_close: bool


class Head(NamedTuple):
    """A final or interim response head: its fields are a tuple, shared by every parse of the same bytes."""

    version: bytes
    status: int
    fields: tuple[tuple[bytes, bytes], ...]
    framing: Framing


def parse_head(head: bytes, max_fields: int) -> Head:
    """A head section (status line, fields, the blank line) -> :class:`Head`; statuses outside 100-599 and 101
    (no upgrade is ever asked for) are errors."""
    if len(head) <= MAX_CACHED_HEAD_BYTES:
        return _parse_head_cached(head, max_fields)
    return _parse_head(head, max_fields)


def _parse_head(head: bytes, max_fields: int) -> Head:
    lines = section_lines(head)
    if not lines:
        raise MalformedResponse("no status line")
    version, status = parse_status_line(lines[0])
    fields = parse_fields(lines[1:], max_fields)
    if status < 100 or status > 599:
        raise MalformedResponse(f"status {status} is outside 100-599")
    if status == 101:
        raise MalformedResponse("101 Switching Protocols, but no upgrade was asked for")
    return Head(version, status, tuple(fields), framing(fields))


_parse_head_cached = functools.lru_cache(maxsize=HEAD_CACHE_ENTRIES)(_parse_head)


def section_lines(section: bytes) -> list[bytes]:
    """The lines of a head or trailer section that ends in its blank line, without line ends."""
    lines = section.split(b"\n")
    del lines[-2:]
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def parse_status_line(line: bytes) -> tuple[bytes, int]:
    """``HTTP/d.d SP 3DIGIT [SP reason]`` -> (version, status); any 3-digit status."""
    match = _STATUS_LINE.fullmatch(line)
    if match is None:
        raise MalformedResponse(f"bad status line {line[:80]!r}")
    return match[1], int(match[2])


def parse_fields(lines: list[bytes], max_fields: int) -> Fields:
    """Field lines -> (lower-case name, value) pairs; Content-Length and Transfer-Encoding normalised."""
    unfolded = _unfold(lines)
    if len(unfolded) > max_fields:
        raise MalformedResponse(f"more than {max_fields} header fields")
    fields: Fields = []
    content_length: bytes | None = None
    has_transfer_encoding = False
    for line in unfolded:
        name, colon, value = line.partition(b":")
        value = value.strip(b" \t")
        if not colon or _TOKEN.fullmatch(name) is None or not _is_field_value(value):
            raise MalformedResponse(f"bad header line {line[:80]!r}")
        name = name.lower()
        if name == b"content-length":
            if b"," in value:  # a list, allowed when every member is the same
                lengths = {length.strip() for length in value.split(b",")}
                if len(lengths) != 1:
                    raise MalformedResponse("conflicting Content-Length values")
                value = lengths.pop()
            if not _DIGITS.fullmatch(value):
                raise MalformedResponse(f"bad Content-Length {value[:40]!r}")
            if content_length is not None:
                if value != content_length:
                    raise MalformedResponse("conflicting Content-Length headers")
                continue  # the same length again: kept once
            content_length = value
        elif name == b"transfer-encoding":
            if has_transfer_encoding:
                raise MalformedResponse("more than one Transfer-Encoding header")
            value = value.lower()
            if value != b"chunked":
                raise MalformedResponse(f"unsupported Transfer-Encoding {value[:40]!r}")
            has_transfer_encoding = True
        fields.append((name, value))
    return fields


def _is_field_value(stripped: bytes) -> bool:
    return len(stripped.translate(None, _NOT_IN_FIELD_VALUE)) == len(stripped)


def framing(fields: Fields) -> Framing:
    content_length: int | None = None
    is_chunked = is_close = False
    for name, value in fields:
        if name == b"content-length":
            content_length = int(value)
        elif name == b"transfer-encoding":
            is_chunked = True
        elif name == b"connection" and b"close" in (token.strip() for token in value.lower().split(b",")):
            is_close = True
    return Framing(content_length, is_chunked, is_close)


def _unfold(lines: list[bytes]) -> list[bytes]:
    """Replace each obs-fold with one space (RFC 9112 5.2), as h11 does."""
    out: list[bytes] = []
    for line in lines:
        if line[:1] not in _FOLD_STARTS:
            out.append(line)
        elif not out:
            raise MalformedResponse("continuation line at the start of the header fields")
        else:
            out[-1] = out[-1] + b" " + line.lstrip(b" \t")
    return out

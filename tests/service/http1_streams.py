"""Hypothesis strategies for HTTP/1.1 response byte streams, valid and broken, split into reads.

A stream is: interim 1xx heads, a final response (framed by Content-Length,
chunked coding with extensions and trailers, the close, or nothing), maybe
bytes after it, maybe one byte inserted, deleted or replaced anywhere, or the
stream cut short. Header
lines mix ordinary fields with broken ones (no colon, a space before the colon,
NUL, CR, obs-fold), and a head sometimes carries a flood at the caps' edges
(95-105 fields, a 64 KiB value give or take a few hundred bytes).
"""

from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st

GOOD_FIELDS = [
    b"Content-Type: application/json", b"Server: uvicorn", b"X-Request-Id: abc-123", b"Content-Encoding: gzip",
    b"Cache-Control: no-cache", b"Link: </a>; rel=preload", b"Connection: keep-alive", b"Connection: close",
    b"Connection: Upgrade, Close", b"X-Empty:", b"X-Padded:   v   ", b"X-Tab:\tv", b"X-Obs: caf\xe9",
    b"X-Ctl: a\x01b", b"x-lower: v", b"Content-Type: text/event-stream", b"  obs-fold continuation", b"\tmore",
]
BAD_FIELDS = [
    b"NoColon", b"Bad Name: v", b"X-Space : v", b":novalue", b"X-Nul: a\x00b", b"X-CR: a\rb", b" folded line",
    b"\tfolded tab", b"X-VT: a\x0bb", b"X-Del: a\x7fb",
]
CHUNK_EXTENSIONS = [b""] * 8 + [b";a=b", b';q="x y"', b";flag", b"; a = b", b";a=b;c", b";\x00x", b"  ", b"\t",
                    b";\r"]
BAD_CHUNK_SIZES = [b"-1", b"g", b"", b" 5", b"0x5", b"1" * 21]
FRAMINGS = ["length"] * 12 + ["chunked"] * 12 + ["close"] * 3 + ["length-short", "length-long", "length-dup-same", "length-dup-diff", "length-list-same",
            "length-list-diff", "length-bad", "chunked-case", "te-gzip-chunked", "te-dup",
            "length+chunked", "close", "none"]
ODD_STATUS_LINES = [b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK", b"http/1.1 200 OK", b"HTTP/1.1  200 OK", b"HTTP/11 200 OK",
                    b"ICY 200 OK", b"HTTP/1.1 200\x00", b" HTTP/1.1 200 OK", b"HTTP/1.1 -20 OK"]



def rarely(usual: st.SearchStrategy, rare: st.SearchStrategy, one_in: int = 12) -> st.SearchStrategy:
    """``rare`` one draw in ``one_in``, else ``usual``: a stream should mostly get far enough to test framing.

    (Rare on 1, not on 0: hypothesis favours the ends of a range, and shrinks towards 0, the usual.)"""
    return st.integers(0, one_in - 1).flatmap(lambda n: rare if n == 1 else usual)


token_chars = st.sampled_from(list(b"abcXYZ09-_!~") + [ord(" "), ord("@"), 0x80])
random_field = st.builds(lambda name, value: bytes(name) + b":" + value,
                         st.lists(token_chars, max_size=6),
                         st.binary(max_size=10).filter(lambda v: b"\n" not in v))
field_line = rarely(st.sampled_from(GOOD_FIELDS), st.one_of(st.sampled_from(BAD_FIELDS), random_field), 10)
eol = st.sampled_from([b"\r\n"] * 7 + [b"\n"])
versions = rarely(st.just(b"1.1"), st.sampled_from([b"1.0", b"1.0", b"2.0", b"0.9"]), 4)
reasons = st.sampled_from([b" OK", b"", b" ", b" Weird \x80 reason", b" tab\there"])
final_codes = rarely(st.sampled_from([200, 201, 204, 304, 400, 404, 500, 502, 503]), st.integers(0, 999), 8)
interim_codes = rarely(st.sampled_from([100, 102, 103]), st.sampled_from([101, 150, 199]), 8)


def status_line(codes: st.SearchStrategy[int]) -> st.SearchStrategy[bytes]:
    good = st.builds(lambda version, code, reason: b"HTTP/%s %03d%s" % (version, code, reason),
                     versions, codes, reasons)
    return rarely(good, st.sampled_from(ODD_STATUS_LINES), 15)


MAX_HEAD_BYTES = 64 * 1024
MAX_FIELDS = 100


def with_flood(draw: st.DrawFn, overhead: int, fields: list[bytes], end: bytes) -> list[bytes]:
    """Now and then, ``fields`` grown to the caps' edge: 99-101 field lines, or a section of 64 KiB - 2
    to + 2 bytes (``overhead``: the section's bytes besides its field lines)."""
    kind = draw(rarely(st.just("none"), st.sampled_from(["fields", "bytes"]), 20))
    if kind == "fields":
        num_fields = sum(1 for line in fields if not line.startswith((b" ", b"\t")))
        wanted = MAX_FIELDS + draw(st.integers(-1, 1))
        return fields + [b"X-F%d: v" % i for i in range(max(0, wanted - num_fields))]
    if kind == "bytes":
        size = overhead + len(end) * len(fields) + sum(map(len, fields))
        pad = MAX_HEAD_BYTES + draw(st.integers(-2, 2)) - size - len(b"X-Big: ") - len(end)
        return fields + [b"X-Big: " + b"a" * max(0, pad)]
    return fields


@st.composite
def head(draw: st.DrawFn, codes: st.SearchStrategy[int], framing_fields: Sequence[bytes] = ()) -> bytes:
    end = draw(eol)
    fields = draw(st.lists(field_line, max_size=4))
    for line in framing_fields:
        fields.insert(draw(st.integers(0, len(fields))), line)
    first = draw(status_line(codes))
    fields = with_flood(draw, len(first) + 2 * len(end), fields, end)
    return first + end + b"".join(line + end for line in fields) + end


@st.composite
def chunked_body(draw: st.DrawFn, body: bytes) -> bytes:
    out = []
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=3)))) if body else []
    for start, end in zip([0] + cuts, cuts + [len(body)]):
        piece = body[start:end]
        if not piece:
            continue
        size = b"%x" % len(piece) if draw(st.booleans()) else b"%X" % len(piece)
        num_digits = draw(rarely(st.integers(0, 2), st.sampled_from([20, 21])))  # 20 hex digits: h11's limit
        size = b"0" * max(0, num_digits - len(size)) + size if num_digits > 2 else b"0" * num_digits + size
        size = draw(rarely(st.just(size), st.sampled_from(BAD_CHUNK_SIZES), 25))
        footer = draw(rarely(st.just(b"\r\n"), st.sampled_from([b"\n", b"", b"XX", b"\r"]), 25))
        out.append(size + draw(st.sampled_from(CHUNK_EXTENSIONS)) + b"\r\n" + piece + footer)
    trailers = draw(rarely(st.just([]), st.lists(field_line, min_size=1, max_size=3), 3))
    end = draw(eol)
    trailers = with_flood(draw, len(end), trailers, end)
    last = b"0" + draw(rarely(st.sampled_from(CHUNK_EXTENSIONS), st.sampled_from([0, 1]).map(
        lambda delta: b";x=" + b"a" * (MAX_HEAD_BYTES + delta - 6)), 10)) + b"\r\n"  # a line at the cap's edge
    out.append(last + b"".join(t + end for t in trailers) + end)
    return b"".join(out)


@st.composite
def final_response(draw: st.DrawFn) -> bytes:
    body = draw(st.binary(max_size=40))
    framing = draw(st.sampled_from(FRAMINGS))
    length = b"%d" % len(body)
    fields: list[bytes] = {
        "length": [b"Content-Length: " + length],
        "length-short": [b"Content-Length: %d" % max(0, len(body) - 1)],
        "length-long": [b"Content-Length: %d" % (len(body) + 3)],
        "length-dup-same": [b"Content-Length: " + length, b"content-length: " + length],
        "length-dup-diff": [b"Content-Length: " + length, b"Content-Length: %d" % (len(body) + 1)],
        "length-list-same": [b"Content-Length: %s, %s" % (length, length)],
        "length-list-diff": [b"Content-Length: %s,%d" % (length, len(body) + 1)],
        "length-bad": [b"Content-Length: " + draw(st.sampled_from([b"abc", b"-1", b"+5", b"0x5", b"1" * 21, b""]))],
        "chunked": [b"Transfer-Encoding: chunked"],
        "chunked-case": [b"Transfer-Encoding: Chunked"],
        "te-gzip-chunked": [b"Transfer-Encoding: gzip, chunked"],
        "te-dup": [b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"],
        "length+chunked": [b"Content-Length: " + length, b"Transfer-Encoding: chunked"],
        "close": [],
        "none": [],
    }[framing]
    is_chunked = "chunked" in framing
    encoded = draw(chunked_body(body)) if is_chunked else b"" if framing == "none" else body
    return draw(head(final_codes, fields)) + encoded


after_response = st.one_of(st.just(b""), st.just(b""), st.just(b""),
                           st.just(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond"), st.binary(max_size=6))


@st.composite
def mutated(draw: st.DrawFn, stream: bytes) -> bytes:
    if not stream or draw(st.integers(0, 7)) != 1:
        return stream
    at = draw(st.integers(0, len(stream) - 1))
    op = draw(st.sampled_from(["insert", "delete", "replace", "truncate"]))
    if op == "truncate":
        return stream[:at]
    byte = bytes([draw(st.sampled_from(list(b"\r\n :\x00\t0aZ;\x80")))])
    if op == "insert":
        return stream[:at] + byte + stream[at:]
    if op == "delete":
        return stream[:at] + stream[at + 1:]
    return stream[:at] + byte + stream[at + 1:]


@st.composite
def response_streams(draw: st.DrawFn) -> bytes:
    interims = draw(rarely(st.just([]), st.lists(head(interim_codes), min_size=1, max_size=3), 3))
    if interims and draw(st.integers(0, 19)) == 0:  # around the cap on interim responses (16)
        interims = interims[:1] * draw(st.integers(15, 18))
    return draw(mutated(b"".join(interims) + draw(final_response()) + draw(after_response)))


@st.composite
def split_points(draw: st.DrawFn, stream: bytes) -> list[bytes]:
    """``stream`` cut into the reads a peer's segments make; sometimes one byte per read."""
    if len(stream) < 400 and draw(st.integers(0, 9)) == 1:
        return [stream[i:i + 1] for i in range(len(stream))]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=8))))
    return [stream[start:end] for start, end in zip([0] + cuts, cuts + [len(stream)]) if start < end]

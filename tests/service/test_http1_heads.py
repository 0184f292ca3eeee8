"""The parsed-head cache of the HTTP/1.1 response parser: shared work, nothing shared that a caller can change,
bounded whatever a peer sends. (That a cached parse answers as h11 does is the differential fuzz's job.)"""

from __future__ import annotations

from collections import deque

import pytest

from handoff.service import http1_fields
from handoff.service.http1_fields import HEAD_CACHE_ENTRIES, MAX_CACHED_HEAD_BYTES
from handoff.service.http1_parser import MalformedResponse, ResponseParser


def parsed(response: bytes) -> ResponseParser:
    parser = ResponseParser(deque())
    parser.feed(response)
    return parser


def test_one_head_parsed_twice_gives_each_parser_its_own_headers() -> None:
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-State: {}\r\n\r\nok"
    first, second = parsed(response), parsed(response)
    assert first.headers == second.headers == [(b"content-length", b"2"), (b"x-state", b"{}")]
    first.headers.append((b"x-injected", b"1"))
    assert parsed(response).headers == second.headers == [(b"content-length", b"2"), (b"x-state", b"{}")]
    assert first.is_done and second.is_done


def test_the_cache_holds_a_bounded_number_of_small_heads() -> None:
    cache = http1_fields._parse_head_cached
    cache.cache_clear()
    for index in range(HEAD_CACHE_ENTRIES + 50):
        parsed(b"HTTP/1.1 204 No Content\r\nX-Index: %d\r\n\r\n" % index)
    assert cache.cache_info().currsize == HEAD_CACHE_ENTRIES
    big = b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * MAX_CACHED_HEAD_BYTES + b"\r\nContent-Length: 0\r\n\r\n"
    before = cache.cache_info()
    assert parsed(big).headers[0] == (b"x-big", b"b" * MAX_CACHED_HEAD_BYTES)
    assert cache.cache_info() == before  # parsed, never stored


@pytest.mark.parametrize("head", [b"HTTP/1.1 999 Odd\r\n\r\n", b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n"])
def test_a_bad_head_fails_every_time(head: bytes) -> None:
    for _ in range(2):
        with pytest.raises(MalformedResponse):
            parsed(head)

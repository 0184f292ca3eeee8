"""A client's request framing at a real LB: what a node gets of a chunked body's trailers, and ambiguous framing
(a smuggling attempt) refused before any node is asked."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest

from handoff.protocol.weights import WEIGHT_VERSION_HEADER
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, set_members

pytestmark = pytest.mark.timeout(30)


def _exchange(lb: LB, raw: bytes) -> bytes:
    """``raw`` written to the LB on one connection; everything it sends back until it closes."""
    address = urlsplit(str(lb.http.base_url))
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


def test_a_chunked_bodys_trailers_never_reach_a_node(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Trailers are dropped: they never override the headers a node gets (its request id, content type, the
    version a request is pinned to), nor add one. Before, uvicorn appended them to the request's headers, so a
    trailer replaced the header the LB passes on."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    body = b'{"text": "hi"}'
    answer = _exchange(shared_lb, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"X-Request-Id: r-1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                                  b"%x\r\n%s\r\n0\r\nX-Request-Id: forged\r\nContent-Type: text/evil\r\n"
                                  b"%s: v-forged\r\nAuthorization: Bearer x\r\n\r\n"
                                  % (len(body), body, WEIGHT_VERSION_HEADER.encode()))
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    [seen] = node.requests_to("/generate")
    assert seen.body == body
    assert seen.headers["x-request-id"] == "r-1" and seen.headers["content-type"] == "application/json"
    assert WEIGHT_VERSION_HEADER.lower() not in {name.lower() for name in seen.headers}


AMBIGUOUS = {
    "content-length and chunked": b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two content-lengths": b"Content-Length: 5\r\nContent-Length: 0\r\n\r\n",
    "chunked, identity": b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "a coding other than chunked": b"Transfer-Encoding: gzip\r\n\r\n",
    "a folded header line": b"Content-Type: application/json\r\n X-Folded: 1\r\nContent-Length: 0\r\n\r\n",
    "a space before the colon": b"Content-Length : 5\r\n\r\n",
    "a bare LF": b"Content-Length: 0\n\n",
    "a CR inside a value": b"X-Request-Id: a\rb\r\nContent-Length: 0\r\n\r\n",
    "a chunk size that is not hex": b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("framing", list(AMBIGUOUS), ids=list(AMBIGUOUS))
def test_ambiguous_framing_is_400_and_reaches_no_node(module_fakes: FakeCluster, shared_lb: LB,
                                                       framing: str) -> None:
    """Each is the 400 ``invalid_request`` envelope, the connection closed; no node gets the request, nor the
    one smuggled behind it."""
    node = module_fakes.start_one()
    set_members(shared_lb, node.url)
    smuggled = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    answer = _exchange(shared_lb, b"POST /generate HTTP/1.1\r\nHost: x\r\n" + AMBIGUOUS[framing] + smuggled)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 ") and b"HTTP/1.1 200 " not in answer, answer
    assert json.loads(body)["error"]["type"] == "invalid_request", answer
    assert node.requests_to("/generate") == []

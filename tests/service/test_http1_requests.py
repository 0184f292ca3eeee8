"""The services' request side (uvicorn's httptools protocol as ``handoff.service.http_protocol`` serves it) against
h11 as the oracle, over real loopback connections to a real server.

The server echoes each request it serves (method, target, headers, body). Generated requests (valid ones and the
usual smuggling shapes: framing headers doubled, signed or listed, codings, folds, bare LFs, NULs, chunk lines with
extensions or odd sizes, upgrades) must be served only as h11 reads them, with the request pipelined behind them
answered too; whatever h11 refuses must be refused. The server may refuse more than h11 does (it refuses folded
lines, bare LFs, unknown methods), never less, and never read a different message.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Iterator

import h11
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Scope, Send

from handoff.service.http_protocol import ServiceProtocol
from tests.support.lifespan import answered_lifespan

pytestmark = pytest.mark.timeout(120)
SECOND = b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n"


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    if await answered_lifespan(scope, receive, send):
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    query = b"?" + scope["query_string"] if scope["query_string"] else b""
    answer = json.dumps({"method": scope["method"], "target": (scope["raw_path"] + query).decode("latin-1"),
                         "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in scope["headers"]],
                         "body": body.decode("latin-1")}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(echo, http=ServiceProtocol.with_timeout(5.0, max_connections=200),
                                           log_config=None, timeout_keep_alive=5))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


class Answers(list):
    is_closed = False  # the server closed the connection (not: stopped sending)


def _asked(client: h11.Connection) -> None:
    """h11 as the client reads an answer only to a request it sent: one it never puts on the wire."""
    client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())


def exchange(port: int, *pieces: bytes, answers: int = 2, wait_s: float = 2.0) -> Answers:
    """``pieces`` written one by one (a moment apart: each in a read of its own); the answers read: a dict (the
    echo of a served request) or the response of a refusal. Stops at ``answers`` answers, the server's close, or
    ``wait_s`` without a byte."""
    client = h11.Connection(h11.CLIENT)
    _asked(client)
    got = Answers()
    response: h11.Response | None = None
    body = b""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        for index, piece in enumerate(pieces):
            try:
                sock.sendall(piece)
            except OSError:  # refused and closed already
                break
            if index < len(pieces) - 1:
                time.sleep(0.2)  # the next piece in a later read
        while len(got) < answers:
            event = client.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = sock.recv(65536)
                except (socket.timeout, ConnectionResetError):
                    break
                client.receive_data(data)
                if not data:
                    got.is_closed = True
                    break
            elif isinstance(event, h11.Response):
                response, body = event, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                got.append(json.loads(body) if response.status_code == 200 else response)
                if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
                    got.is_closed = True
                    break
                client.start_next_cycle()
                _asked(client)
            elif isinstance(event, h11.ConnectionClosed):
                got.is_closed = True
                break
    return got


def refused(answers: list[h11.Response | dict]) -> bool:
    return len(answers) == 1 and isinstance(answers[0], h11.Response) and answers[0].status_code == 400


# -- the cases h11 refuses that httptools let through ------------------------------------------------------------
UPGRADE_HEAD = b"POST /first HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: foo\r\nContent-Length: %d\r\n\r\n"


def test_an_upgrade_requests_body_is_never_read_as_a_request(port: int) -> None:
    """httptools skips an upgrade request's body: sent in a later read, it was served as a request of its own
    (smuggled past anything in front that framed it as a body); in the same read it was dropped, and the handler
    got an empty body although Content-Length said otherwise."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    assert refused(exchange(port, UPGRADE_HEAD % len(smuggled), smuggled))
    assert refused(exchange(port, UPGRADE_HEAD % len(smuggled) + smuggled + SECOND))
    chunked = UPGRADE_HEAD.replace(b"Content-Length: %d", b"Transfer-Encoding: chunked")
    assert refused(exchange(port, chunked, b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)))


def test_a_bodiless_upgrade_request_is_served_and_its_connection_closed(port: int) -> None:
    """``curl --http2`` asks for h2c on a GET: served, then closed (httptools dropped what followed in its read,
    so nothing after it is answered; before, the request pipelined behind it waited forever)."""
    answers = exchange(port, b"GET /first HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                             b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n" + SECOND)
    assert answers.is_closed and len(answers) == 1, answers
    assert isinstance(answers[0], dict) and answers[0]["target"] == "/first", answers


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST / HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
], ids=["no Host", "two Hosts", "two Hosts in HTTP/1.0", "gzip, chunked", "chunked in HTTP/1.0"])
def test_heads_httptools_accepts_and_the_rfc_refuses_are_400(port: int, head: bytes) -> None:
    answers = exchange(port, head + SECOND)
    assert refused(answers), answers


def test_an_http_1_0_request_without_host_is_served(port: int) -> None:
    [answer] = exchange(port, b"GET /old HTTP/1.0\r\n\r\n")
    assert isinstance(answer, dict) and answer["target"] == "/old"


# -- the differential fuzz ------------------------------------------------------------------------------------------
def _value(options: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.sampled_from(options)


FIELDS = st.one_of(
    st.tuples(st.just(b"Host"), _value([b"x", b"127.0.0.1:80", b"", b"a b"])),
    st.tuples(st.just(b"Content-Length"), _value([b"0", b"3", b"03", b"+3", b"-3", b"3, 3", b"3,4", b" 3 ", b"3 3",
                                                  b"0x3", b"99999999999999999999999"])),
    st.tuples(st.sampled_from([b"Transfer-Encoding", b"transfer-encoding"]),
              _value([b"chunked", b"CHUNKED", b" chunked ", b"gzip, chunked", b"chunked, gzip", b"identity",
                      b"chunked, chunked", b"gzip", b"chunked\x00"])),
    st.tuples(st.just(b"Connection"), _value([b"keep-alive", b"close", b"upgrade", b"Upgrade, HTTP2-Settings"])),
    st.tuples(st.just(b"Upgrade"), _value([b"h2c", b"websocket", b"foo"])),
    st.tuples(st.just(b"Expect"), _value([b"100-continue", b"foo"])),
    st.tuples(st.sampled_from([b"X-A", b"X A", b"X-A ", b"X\x01A", b"", b"X-A\t"]),
              _value([b"1", b"a\x00b", b"a\rb", b"a\tb", b"\xff", b"a\x7fb", b" "])),
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"get", b"G(T", b"FOO"]))
    target = draw(st.sampled_from([b"/", b"/a?b=c", b"/%41", b"*", b"a", b"http://h/p?q", b"/a b", b"/\x01"]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"http/1.1"]))
    fields = draw(st.lists(FIELDS, max_size=4))
    if draw(st.booleans()):
        fields.insert(0, (b"Host", b"x"))
    eol = draw(st.sampled_from([b"\r\n"] * 6 + [b"\n"]))
    lines = [method + b" " + target + b" " + version]
    for name, value in fields:
        lines.append(name + b": " + value)
        if draw(st.integers(0, 15)) == 0:
            lines.append(b" folded")
    head = eol.join(lines) + eol + eol
    names = {name.lower() for name, _ in fields}
    if b"transfer-encoding" in names:
        sizes = draw(st.lists(st.integers(1, 20), max_size=3))
        body = b""
        for size in sizes:
            line = draw(st.sampled_from([b"%x" % size, b"%X" % size, b"%x;ext=1" % size, b"%x " % size,
                                         b"0%x" % size]))
            end = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n"]))
            body += line + end + b"d" * size + b"\r\n"
        body += b"0\r\n" + draw(st.sampled_from([b"", b"X-T: 1\r\n"])) + b"\r\n"
    else:
        body = b"abc" * draw(st.integers(0, 1))
    return head + body


def h11_reads(data: bytes) -> tuple[dict, bool] | None:
    """The first request h11 reads in ``data`` as the echo would say it, and whether h11 reads the next one as
    ``GET /second``; None when h11 refuses it. (``data`` holds the whole first message, or h11 needs more: a
    refusal.)"""
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    try:
        request = server.next_event()
        if not isinstance(request, h11.Request):
            return None
        body = b""
        while not isinstance(event := server.next_event(), h11.EndOfMessage):
            if not isinstance(event, h11.Data):
                return None  # needs data the request does not hold: its framing reads past it
            body += event.data
    except h11.RemoteProtocolError:
        return None
    echo = {"method": request.method.decode(), "target": request.target.decode("latin-1"),
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in request.headers],
            "body": body.decode("latin-1")}
    if server.our_state is h11.MUST_CLOSE or server.their_state not in (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL):
        return echo, False
    server.send(h11.Response(status_code=204, headers=[]))  # an upgrade asked for is not taken: the next cycle
    server.send(h11.EndOfMessage())
    if server.states != {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
        return echo, False
    server.start_next_cycle()
    try:
        second = server.next_event()
    except h11.RemoteProtocolError:
        return echo, False
    return echo, isinstance(second, h11.Request) and second.target == b"/second"


def normal(headers: list[list[str]]) -> list[list[str]]:
    """Header fields as h11 gives them: lower-case names, a lower-case Transfer-Encoding."""
    return [[n.lower(), v.lower() if n.lower() == "transfer-encoding" else v] for n, v in headers]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(request=requests())
def test_a_request_is_served_only_as_h11_reads_it(port: int, request: bytes) -> None:
    answers = exchange(port, request + SECOND, wait_s=1.0)
    oracle = h11_reads(request + SECOND)
    context = f"request={request!r}\nserved={answers}\nh11={oracle}"
    if not answers or not isinstance(answers[0], dict):
        assert answers and answers[0].status_code == 400 and len(answers) == 1, context  # a refusal, and only it
        return
    assert oracle is not None, context  # served what h11 refuses
    echo, reads_second = oracle
    served = answers[0]
    assert (served["method"], served["body"]) == (echo["method"], echo["body"]), context
    assert normal(served["headers"]) == normal(echo["headers"]), context
    if echo["target"].startswith("/"):
        assert served["target"] == echo["target"], context
    if reads_second:  # the request pipelined behind it is answered (or refused), unless the server closed first
        assert len(answers) == 2 or (answers.is_closed and len(answers) == 1), context
    if len(answers) == 2 and isinstance(answers[1], dict):  # served only as h11 reads it
        assert reads_second and answers[1]["target"] == "/second", context

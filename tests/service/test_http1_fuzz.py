"""Differential fuzzing of the upstream client's HTTP/1.1 response handling against h11.

Generated response streams (``http1_streams``) are split at random points and
fed to our client two ways: straight into a :class:`Connection` (the pieces are
exactly its ``data_received`` calls, with or without the peer's close), and
through a real loopback socket from a server thread that writes the pieces and
closes. Each outcome must be what :func:`h11_oracle.expected` says: the same
status, headers and body, the same "may this connection carry another
request", or a rejection (our deliberate differences from h11 are rules in the
oracle, documented there).
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handoff.service.http1 import Connection, ConnState
from handoff.service.http1_request import Origin
from handoff.service.upstream import ConnectionDropped, ProtocolError, UpstreamClient, UpstreamResponse
from tests.service.h11_oracle import MAX_FIELDS, MAX_HEAD_BYTES, MAX_INTERIM_RESPONSES, Outcome, expected
from tests.service.http1_streams import response_streams, split_points

pytestmark = pytest.mark.timeout(300)
CAP = 1 << 20
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def observed_error(exc: BaseException) -> Outcome:
    if isinstance(exc, ProtocolError):
        return Outcome("reject", why=str(exc))
    if isinstance(exc, ConnectionDropped):
        return Outcome("reject", is_at_eof=True, why=str(exc))
    raise AssertionError(f"neither a protocol error nor a dropped connection: {exc!r}")


def check(got: Outcome, want: Outcome, stream: bytes) -> None:
    context = f"stream={stream!r}\nours={got}\nh11={want}"
    if got.kind == "reject" and not got.is_at_eof and want.may_reject_early:
        return  # an unfinished framing section past the cap: rejected before the peer's close
    assert got.kind == want.kind, context
    if got.kind == "reject":
        assert got.is_at_eof == want.is_at_eof, context
        return
    assert (got.status, got.headers, got.body) == (want.status, want.headers, want.body), context
    assert got.is_reusable == want.is_reusable, context


# -- straight into the protocol object ------------------------------------------------------------
class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.is_aborted = False

    def write(self, data: bytes) -> None:  # the request: nobody reads it
        pass

    def is_closing(self) -> bool:
        return self.is_aborted

    def abort(self) -> None:
        self.is_aborted = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def through_connection(pieces: list[bytes], *, is_eof: bool, method: str) -> Outcome:
    loop = asyncio.get_running_loop()
    conn = Connection(Origin("peer", 80, "peer"), loop, lambda _: None)
    transport = FakeTransport()
    conn.connection_made(transport)
    assert conn.send("http://peer/", method, b"", b"", None)
    for piece in pieces:
        if transport.is_aborted:
            break  # a closed transport delivers nothing more
        conn.data_received(piece)
    if is_eof and not transport.is_aborted:
        conn.eof_received()
        conn.connection_lost(None)
    try:
        await conn.receive_headers() if (conn.is_headers_done or conn._failure) else None
    except (ProtocolError, ConnectionDropped) as exc:
        return observed_error(exc)
    if not conn.is_headers_done:
        return Outcome("incomplete")
    headers = tuple(conn.headers)
    if not conn.is_message_done and conn._failure is None:
        return Outcome("incomplete", conn.status, headers, b"".join(conn._chunks))
    released: list[bool] = []
    response = UpstreamResponse("http://peer/", conn, lambda c: released.append(
        c.state is ConnState.BUSY and c.is_keep_alive and not transport.is_aborted))
    try:
        body = await response.read_whole(CAP)
    except (ProtocolError, ConnectionDropped) as exc:
        return observed_error(exc)
    return Outcome("complete", conn.status, headers, body, is_reusable=released == [True])


@pytest.fixture(scope="module")
def loops() -> Iterator[dict[str, asyncio.AbstractEventLoop]]:
    made = {"asyncio": asyncio.new_event_loop()}
    try:
        import uvloop
        made["uvloop"] = uvloop.new_event_loop()
    except ImportError:
        pass
    yield made
    for loop in made.values():
        loop.close()


@settings(max_examples=600, **SETTINGS)
@given(data=st.data(), is_eof=st.booleans(), method=st.sampled_from(["GET"] * 5 + ["HEAD"]))
def test_connection_reads_what_h11_reads(loops: dict[str, asyncio.AbstractEventLoop], data: st.DataObject,
                                         is_eof: bool, method: str) -> None:
    stream = data.draw(response_streams(), label="stream")
    pieces = data.draw(split_points(stream), label="pieces")
    got = loops["asyncio"].run_until_complete(through_connection(pieces, is_eof=is_eof, method=method))
    check(got, expected(stream, is_eof=is_eof, method=method.encode()), stream)


def edge_streams() -> dict[str, bytes]:
    """Streams exactly at, and one byte past, each cap: the fuzz reaches these edges only now and then."""
    start = b"HTTP/1.1 200 OK\r\n"
    chunked = start + b"Transfer-Encoding: chunked\r\n\r\n"

    def head_of(size: int) -> bytes:  # a head of ``size`` bytes, blank line included
        framing = b"Content-Length: 0\r\n"
        return start + framing + b"X-Big: " + b"a" * (size - len(start) - len(framing) - 11) + b"\r\n\r\n"

    def fields(count: int) -> bytes:
        return b"".join(b"X-%d: v\r\n" % i for i in range(count))

    streams = {}
    for extra in (0, 1):
        streams[f"head +{extra}"] = head_of(MAX_HEAD_BYTES + extra)
        streams[f"fields +{extra}"] = start + fields(MAX_FIELDS - 1 + extra) + b"Content-Length: 0\r\n\r\n"
        streams[f"chunk line +{extra}"] = chunked + b"1;x=" + b"a" * (MAX_HEAD_BYTES + extra - 6) + b"\r\nz\r\n0\r\n\r\n"
        streams[f"trailer fields +{extra}"] = chunked + b"0\r\n" + fields(MAX_FIELDS + extra) + b"\r\n"
        trailer = b"X-T: " + b"a" * (MAX_HEAD_BYTES + extra - 9) + b"\r\n"
        streams[f"trailer bytes +{extra}"] = chunked + b"0\r\n" + trailer + b"\r\n"
        interims = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * (MAX_INTERIM_RESPONSES + extra)
        streams[f"interim responses +{extra}"] = interims + start + b"Content-Length: 0\r\n\r\n"
    return streams


@pytest.mark.parametrize("name", list(edge_streams()))
def test_caps_edges_agree_with_the_oracle(loops: dict[str, asyncio.AbstractEventLoop], name: str) -> None:
    stream = edge_streams()[name]
    want = expected(stream, is_eof=False)
    assert want.kind == ("complete" if name.endswith("+0") else "reject"), want
    middle = len(stream) // 2
    for pieces in ([stream], [stream[:middle], stream[middle:]]):
        check(loops["asyncio"].run_until_complete(through_connection(pieces, is_eof=False, method="GET")),
              want, stream)


def test_a_size_line_cut_then_read_whole_agrees_with_the_oracle(loops: dict[str, asyncio.AbstractEventLoop]) -> None:
    """A chunk-size line split across reads, then finished by the whole-chunk fast path: the next size line
    is looked for from its own start (a stale search offset once skipped it)."""
    stream = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n00000000000000000001\r\na\r\n0\r\n\r\n"
    want = expected(stream, is_eof=False)
    for cut in range(1, len(stream)):
        for more in (len(stream), cut + 22):
            pieces = [p for p in (stream[:cut], stream[cut:more], stream[more:]) if p]
            check(loops["asyncio"].run_until_complete(through_connection(pieces, is_eof=False, method="GET")),
                  want, stream)


# -- through a real socket ------------------------------------------------------------------------
class PieceServer:
    """A loopback server thread: each connection reads one request head, then gets the next script's
    pieces, one ``sendall`` each, and the close."""

    def __init__(self) -> None:
        self.scripts: queue.Queue[list[bytes]] = queue.Queue()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed: the module is done
            with conn:
                self._answer(conn, self.scripts.get(timeout=30))

    @staticmethod
    def _answer(conn: socket.socket, pieces: list[bytes]) -> None:
        conn.settimeout(30)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = b""
        while b"\r\n\r\n" not in request:
            more = conn.recv(4096)
            if not more:
                return
            request += more
        try:
            for piece in pieces:
                conn.sendall(piece)
        except OSError:
            pass  # the client gave up on the stream: it closed first

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def piece_server() -> Iterator[PieceServer]:
    server = PieceServer()
    yield server
    server.close()


async def through_socket(server: PieceServer, pieces: list[bytes]) -> Outcome:
    client = UpstreamClient()
    server.scripts.put(pieces)
    try:
        response = await client.request("GET", server.url, timeout=20)
        body = await response.read_whole(CAP)
    except (ProtocolError, ConnectionDropped) as exc:
        return observed_error(exc)
    finally:
        await client.aclose()
    return Outcome("complete", response.status, tuple(response.headers), body)


@settings(max_examples=150, **SETTINGS)
@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@given(data=st.data())
def test_client_over_a_socket_reads_what_h11_reads(loops: dict[str, asyncio.AbstractEventLoop],
                                                   piece_server: PieceServer, loop_name: str,
                                                   data: st.DataObject) -> None:
    if loop_name not in loops:
        pytest.skip("uvloop is not installed")
    stream = data.draw(response_streams(), label="stream")
    pieces = data.draw(split_points(stream), label="pieces")
    got = loops[loop_name].run_until_complete(through_socket(piece_server, pieces))
    want = expected(stream, is_eof=True)
    check(got, Outcome(want.kind, want.status, want.headers, want.body, False, want.is_at_eof,
                       want.may_reject_early), stream)

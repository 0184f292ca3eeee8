"""Resource exhaustion of a real LB process: what many clients together may make it hold is bounded."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.lb.fakes import FakeCluster
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(60)

MIB = 1024 * 1024


def _open_upload(url: str, declared: int, sent: int) -> socket.socket:
    """A /generate whose head declares ``declared`` bytes of body, of which ``sent`` are sent (the rest never),
    once the LB has taken the request in (its ``100 Continue``: the app is reading the body)."""
    host, port = url[len("http://"):].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % declared)
    assert conn.recv(65536).startswith(b"HTTP/1.1 100 ")
    conn.sendall(b" " * sent)
    return conn


def test_the_bodies_all_clients_hold_at_once_are_bounded(fakes: FakeCluster, start_lb) -> None:
    """Uploads in progress count against --max-buffered-body-bytes as their bytes arrive: past it a request is
    503 ``overloaded`` with Retry-After (before the fix sixteen concurrent 60 MiB bodies grew the LB to 2 GiB:
    only each body was bounded); the budget comes back when they end."""
    lb = start_lb("--node", fakes.start_one().url, "--max-body-bytes", str(4 * MIB),
                  "--max-buffered-body-bytes", str(8 * MIB))
    body = b'{"text": "' + b"a" * (2 * MIB) + b'", "sampling_params": {"max_new_tokens": 1}}'
    assert lb.http.post("/generate", content=body).status_code == 200
    uploads = [_open_upload(lb.url, 4 * MIB, 4 * MIB - 1) for _ in range(2)]  # 8 MiB held, less 2 bytes

    deadline = time.monotonic() + 20  # until the LB has read (and counted) the uploads' bytes
    while (answer := lb.http.post("/generate", content=body)).status_code == 200:
        assert time.monotonic() < deadline, "the uploads' bytes were never counted"
    # a 503, read whole by a client that sent its whole body first (the rest was read and dropped, never held):
    # never a reset connection
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "overloaded" and int(answer.headers["retry-after"]) >= 1
    assert lb.http.get("/health").status_code == 200  # a request without a body still passes
    for conn in uploads:
        conn.close()
    wait_until(lambda: lb.http.post("/generate", content=body).status_code == 200, timeout=20,
               what="the budget given back by the uploads that ended")


def test_a_declared_length_alone_holds_no_budget(fakes: FakeCluster, start_lb) -> None:
    """Only bytes that arrived count: connections that declare the largest body and send nothing (held until
    --body-timeout) must not deny every other client a body."""
    lb = start_lb("--node", fakes.start_one().url, "--max-body-bytes", str(4 * MIB),
                  "--max-buffered-body-bytes", str(8 * MIB))
    silent = [_open_upload(lb.url, 4 * MIB, 0) for _ in range(4)]  # 16 MiB declared, nothing sent
    body = b'{"text": "' + b"a" * (2 * MIB) + b'", "sampling_params": {"max_new_tokens": 1}}'
    assert lb.http.post("/generate", content=body).status_code == 200
    for conn in silent:
        conn.close()


def test_a_budget_smaller_than_one_body_is_a_flag_error(fakes: FakeCluster, start_lb) -> None:
    from tests.support.procs import ProcessFailed

    with pytest.raises(ProcessFailed):
        start_lb("--node", fakes.start_one().url, "--max-body-bytes", str(4 * MIB),
                 "--max-buffered-body-bytes", str(MIB))


def _connect(url: str) -> socket.socket:
    host, port = url[len("http://"):].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _first_answer(conn: socket.socket) -> bytes:
    """One whole answer (head and its Content-Length of body), or what came before the connection closed."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
        piece = conn.recv(65536)
        if not piece:
            break
        data += piece
    return data


def _answer_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return len(head) + 4 + (int(lengths[0]) if lengths else 0)


def test_open_connections_are_bounded_idle_ones_give_way(fakes: FakeCluster, start_lb) -> None:
    """Past --max-connections a new connection closes the oldest idle one (before the fix a client holding as
    many idle keep-alive connections as the process may open files had every other connection reset); when
    every connection has a request in progress, the new one is 503 ``overloaded`` with Retry-After."""
    lb = start_lb("--node", fakes.start_one().url, "--max-connections", "20")
    idle = []
    for _ in range(20):
        conn = _connect(lb.url)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _first_answer(conn).startswith(b"HTTP/1.1 200")
        idle.append(conn)
    assert httpx.get(lb.url + "/health", timeout=10).status_code == 200  # another client gets in
    assert idle[0].recv(1) == b""  # the oldest idle connection made way (it waited 75 s for its next request)

    busy = [_open_upload(lb.url, 1024, 10) for _ in range(20)]  # requests in progress: never closed for others
    got = [conn.recv(100) for conn in idle[1:]]
    assert got == [b""] * 19, got  # the idle ones made way for them, oldest first
    probe = _connect(lb.url)
    answer = _first_answer(probe)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b'"type": "overloaded"' in answer and b"retry-after: 1" in answer.lower()
    for conn in [probe, *idle, *busy]:
        conn.close()
    wait_until(lambda: httpx.get(lb.url + "/health", timeout=10).status_code == 200, timeout=20,
               what="connections again once the busy ones closed")

"""The servers the client tests talk to: the scripted one, and a raw-socket one for what a well-behaved HTTP
framework will not send."""

from __future__ import annotations

import socket
import threading
from typing import Callable, Iterator

import pytest

from tests.support.procs import ServerProcess


@pytest.fixture(scope="module")
def server(proc_log_dir) -> Iterator[ServerProcess]:
    proc = ServerProcess("tests.support.scripted_app", [], log_dir=proc_log_dir, name="scripted")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def raw_server() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """``raw_server(behaviour)``: the URL of a server that reads each request's head and runs ``behaviour`` on
    the connection (the method and path are ignored), until the test ends."""
    stops: list[Callable[[], None]] = []

    def start(behaviour: Callable[[socket.socket], None]) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        stop = threading.Event()

        def serve_one(conn: socket.socket) -> None:
            with conn:
                conn.settimeout(10)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    piece = conn.recv(4096)
                    if not piece:
                        return
                    head += piece
                try:
                    behaviour(conn)
                except OSError:
                    return  # the client left, as it should

        def accept() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()

        def halt() -> None:
            stop.set()
            thread.join(timeout=5)
            listener.close()
        stops.append(halt)
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    for halt in stops:
        halt()

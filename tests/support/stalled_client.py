"""A client that stops reading: a raw socket with a small receive window that sends requests and reads nothing,
and the kernel's send queue of the server towards it (/proc/net/tcp), to wait until that queue is full."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Callable

from tests.support.procs import wait_until

HAS_PROC_NET_TCP = Path("/proc/net/tcp").exists()


def send_queue(local_port: int, remote_port: int) -> int:
    """The bytes the kernel holds unsent on the socket from ``local_port`` to ``remote_port`` (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == remote_port:
            return int(queues.split(":")[0], 16)
    return 0


def stops_growing(read: Callable[[], int], still_s: float = 0.5) -> Callable[[], bool]:
    """A predicate true once ``read()`` is above 0 and the same for ``still_s``."""
    last: list[float] = [0, 0.0]  # value, when it was first seen

    def check() -> bool:
        value, now = read(), time.monotonic()
        if value != last[0]:
            last[:] = [value, now]
        return value > 0 and now - last[1] >= still_s

    return check


def post(body: dict[str, Any], path: str = "/generate") -> bytes:
    """One HTTP/1.1 POST of ``body`` as JSON, as bytes on the wire."""
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


def client_that_never_reads(url: str, *bodies: dict[str, Any]) -> socket.socket:
    """``bodies`` POSTed to ``url``'s ``/generate`` one after another on one connection (pipelined) whose client
    never reads (a receive window of a few KiB, soon closed)."""
    host, port = url[len("http://"):].rsplit(":", 1)
    conn = socket.socket()
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(30)
        conn.connect((host, int(port)))
        conn.sendall(b"".join(post(body) for body in bodies))
    except BaseException:
        conn.close()
        raise
    return conn


def wait_stalled(server_url: str, conn: socket.socket, timeout: float = 60) -> None:
    """Until the server's kernel queue to ``conn`` is full (what it holds unsent no longer grows)."""
    server_port, client_port = int(server_url.rsplit(":", 1)[1]), conn.getsockname()[1]
    wait_until(stops_growing(lambda: send_queue(server_port, client_port), still_s=1.0), timeout=timeout,
               what="the client's window closed")

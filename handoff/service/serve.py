"""Serve an ASGI app with uvicorn on a socket we bind ourselves.

Binding the socket here lets ``--port 0`` pick a free port and publish it
through ``--port-file`` (tests and ``handoff up`` start processes this way, with
no race on a port chosen in advance).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from pathlib import Path

import uvicorn

from handoff.service.head_timeout import DEFAULT_HEAD_TIMEOUT_S, HeadTimeoutProtocol
from handoff.service.limits import DEFAULT_BODY_TIMEOUT_S

log = logging.getLogger(__name__)


def add_server_args(parser: argparse.ArgumentParser, *, default_host: str, default_port: int) -> None:
    """Flags every service shares: address, port file, logging."""
    parser.add_argument("--host", default=default_host, help=f"address to bind (default {default_host})")
    parser.add_argument("--port", type=int, default=default_port, help="port to bind; 0 picks a free one")
    parser.add_argument("--port-file", type=Path, default=None,
                        help="write the bound port to this file once listening")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEAD_TIMEOUT_S, metavar="S",
                        help="a request's head must arrive within this time, else 408 and the connection "
                             f"closes (default {DEFAULT_HEAD_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="a request's body must arrive within this time of its head, else 408 "
                             f"(default {DEFAULT_BODY_TIMEOUT_S:g})")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app: object, *, host: str, port: int, port_file: Path | None = None,
          graceful_shutdown_s: float = 5.0, header_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S) -> None:
    """Run ``app`` until SIGINT/SIGTERM; blocks. Request heads must arrive within ``header_timeout_s``."""
    if not header_timeout_s > 0:
        raise ValueError(f"--header-timeout must be > 0, got {header_timeout_s}")
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    config = uvicorn.Config(
        app,
        loop=loop,
        http=HeadTimeoutProtocol.with_timeout(header_timeout_s),
        lifespan="on",
        access_log=False,
        log_config=None,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    server = uvicorn.Server(config)
    log.info("listening on http://%s:%d", host if ":" not in host else f"[{host}]", bound_port)
    if port_file is not None:
        tmp = port_file.with_suffix(port_file.suffix + ".tmp")
        tmp.write_text(str(bound_port))
        os.replace(tmp, port_file)
    asyncio.run(server.serve(sockets=[sock])) if loop == "asyncio" else _run_uvloop(server, sock)


def _run_uvloop(server: uvicorn.Server, sock: socket.socket) -> None:
    import uvloop

    uvloop.run(server.serve(sockets=[sock]))

"""Serve an ASGI app with uvicorn on a socket we bind ourselves.

Binding the socket here lets ``--port 0`` pick a free port and publish it
through ``--port-file`` (tests and ``handoff up`` start processes this way, with
no race on a port chosen in advance).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import uvicorn

from handoff.service.flag_types import host_name, port_file, port_number, positive_int, positive_seconds, seconds
from handoff.service.head_timeout import DEFAULT_HEAD_TIMEOUT_S, default_max_connections
from handoff.service.http_protocol import ServiceProtocol
from handoff.service.limits import BODY_BUDGET, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BUFFERED_BODY_BYTES
from handoff.service.shutdown_cut import ShutdownCut

log = logging.getLogger(__name__)


DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def add_server_args(parser: argparse.ArgumentParser, *, default_host: str, default_port: int) -> None:
    """Flags every service shares: address, port file, logging, timeouts of a request and of shutting down."""
    parser.add_argument("--host", type=host_name, default=default_host,
                        help=f"address to bind (default {default_host})")
    parser.add_argument("--port", type=port_number, default=default_port, help="port to bind; 0 picks a free one")
    parser.add_argument("--port-file", type=port_file, default=None,
                        help="write the bound port to this file once listening")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--header-timeout", type=positive_seconds, default=DEFAULT_HEAD_TIMEOUT_S, metavar="S",
                        help="a request's head must arrive within this time, else 408 and the connection "
                             f"closes (default {DEFAULT_HEAD_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=positive_seconds, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="a request's body must arrive within this time of its head, else 408 "
                             f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                        help="open client connections at most: past it a new one closes the oldest idle one, or "
                             "is 503 overloaded when all have a request in progress (default: the open-file limit "
                             "less 128, halved)")
    parser.add_argument("--max-buffered-body-bytes", type=positive_int, default=DEFAULT_MAX_BUFFERED_BODY_BYTES,
                        metavar="N",
                        help="the request bodies all requests may hold at once; a request past it is 503 "
                             f"overloaded with Retry-After (default {DEFAULT_MAX_BUFFERED_BODY_BYTES}; at least "
                             "--max-body-bytes)")
    parser.add_argument("--shutdown-timeout", type=seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                        help="on SIGTERM, stop taking connections and give the requests in flight this long to "
                             "finish before they are cut (default "
                             f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}; in Kubernetes, the node's drain timeout)")


def exit_on_sigterm() -> None:
    """Until :func:`serve` installs its graceful handlers, SIGTERM ends the process (exit 143).

    In a container the process is PID 1, for which the kernel ignores a signal that has no handler: an engine
    still loading its model would otherwise sit out the pod's whole termination grace period."""
    def stop(signum: int, frame: object) -> None:
        log.info("SIGTERM before serving: exiting")
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)


def check_server_args(args: argparse.Namespace) -> None:
    """Exits 2 naming the flag when flags of :func:`add_server_args` disagree (each alone is checked by its
    type); a process that loads a model calls it before loading."""
    max_body_bytes = getattr(args, "max_body_bytes", 0)
    if args.max_buffered_body_bytes < max_body_bytes:
        log.error("--max-buffered-body-bytes (%d) must be at least --max-body-bytes (%d)",
                  args.max_buffered_body_bytes, max_body_bytes)
        raise SystemExit(2)


def serve_from_args(app: object, args: argparse.Namespace, *, freeze_startup_objects: bool = False,
                    reserved: socket.socket | None = None) -> None:
    """:func:`serve` with the flags of :func:`add_server_args` (``reserved``: :func:`reserve_socket`'s of them)."""
    check_server_args(args)
    BODY_BUDGET.limit = args.max_buffered_body_bytes
    serve(app, host=args.host, port=args.port, port_file=args.port_file, graceful_shutdown_s=args.shutdown_timeout,
          header_timeout_s=args.header_timeout, max_connections=args.max_connections,
          freeze_startup_objects=freeze_startup_objects, reserved=reserved)


def reserve_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and not listening yet (a connection to it is refused, as to no socket); exits
    2 with one line naming the address when it cannot be had (in use, not an address of this machine, a port out of
    range). A process that loads a model takes its address before, so that it exits at once, not after minutes of
    loading. (SO_REUSEADDR passes a port another process has bound and not listened on yet: its listen fails.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        raise SystemExit(2) from None
    return sock


def bind_socket(host: str, port: int, reserved: socket.socket | None = None) -> socket.socket:
    """A listening socket on ``host:port`` (``reserved``: the one :func:`reserve_socket` bound there before); exits 2
    with one line naming the address when it cannot be had. It stays close-on-exec: a process the service starts
    (torch's shared-memory manager, spawned by the engine's first tensor push, outlives it) must not hold the port
    after the service is gone, or a restart on it finds it taken."""
    sock = reserve_socket(host, port) if reserved is None else reserved
    try:
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        raise SystemExit(2) from None
    return sock


def serve(app: object, *, host: str, port: int, port_file: Path | None = None,
          graceful_shutdown_s: float = 5.0, header_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
          max_connections: int | None = None, freeze_startup_objects: bool = False,
          reserved: socket.socket | None = None) -> None:
    """Run ``app`` until SIGINT/SIGTERM; blocks. Request heads must arrive within ``header_timeout_s``; at most
    ``max_connections`` client connections are open (None: :func:`default_max_connections`).

    ``freeze_startup_objects``: what exists when serving starts (the imports, the app) leaves the garbage
    collector's generations (``gc.freeze``): a full collection no longer walks it. Only for a process whose
    startup objects live until exit and are never dropped in a reference cycle with later ones (such a cycle
    would never be collected): the LB, which builds its cluster in the lifespan, after the freeze."""
    if not header_timeout_s > 0:
        raise ValueError(f"--header-timeout must be > 0, got {header_timeout_s}")
    sock = bind_socket(host, port, reserved)
    bound_port = sock.getsockname()[1]
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    config = uvicorn.Config(
        ShutdownCut(app, grace_s=graceful_shutdown_s),
        loop=loop,
        http=ServiceProtocol.with_timeout(
            header_timeout_s, default_max_connections() if max_connections is None else max_connections),
        lifespan="on",
        access_log=False,
        log_config=None,
        proxy_headers=False,  # nothing reads a forwarded client address; its middleware ran on every request
        timeout_keep_alive=75,
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    server = uvicorn.Server(config)
    log.info("listening on http://%s:%d", host if ":" not in host else f"[{host}]", bound_port)
    if port_file is not None:
        _write_port_file(port_file, bound_port)
    _stop_on_signals(server)
    if freeze_startup_objects:
        # each full collection walked all of them (tens of thousands): a pause of ~25 ms every few hundred requests
        gc.collect()  # what is garbage already goes first, not into the frozen set
        gc.freeze()
    asyncio.run(server.serve(sockets=[sock])) if loop == "asyncio" else _run_uvloop(server, sock)


def _stop_on_signals(server: uvicorn.Server) -> None:
    """SIGINT and SIGTERM stop ``server`` gracefully from here on, in place of what was there (the engine's
    :func:`exit_on_sigterm`, Python's KeyboardInterrupt). uvicorn takes both over while it serves, then puts these
    back and raises the signal it caught once more: this handler takes it as done, so the process exits 0 after its
    graceful shutdown, not by the signal (143) nor with a traceback. A signal ignored (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (and uvicorn then sets none)

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True  # before uvicorn serves: it starts, then stops at once

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, stop)


def _write_port_file(port_file: Path, port: int) -> None:
    """Written whole (a reader polling for it never sees half a number); exits 2 naming the file when it cannot be."""
    tmp = port_file.with_suffix(port_file.suffix + ".tmp")
    try:
        tmp.write_text(str(port))
        os.replace(tmp, port_file)
    except OSError as exc:
        log.error("--port-file %s: %s", port_file, exc.strerror or exc)
        raise SystemExit(2) from None


def _run_uvloop(server: uvicorn.Server, sock: socket.socket) -> None:
    import uvloop

    uvloop.run(server.serve(sockets=[sock]))

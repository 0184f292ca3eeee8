"""Fake nodes: real HTTP servers on loopback that imitate a handoff sidecar, and misbehave on demand.

All fake nodes of a test run on one asyncio loop in a background thread, so a
test can start 150 of them cheaply and talk to the LB with plain blocking
``httpx``. A node answers like a sidecar (``/memory_occupation``, control
endpoints with ``"success": true`` and the node's state in a header,
``/generate`` JSON or SSE) unless a path
has its own handler (see :mod:`tests.lb.behaviours` for ``reply``, ``hang``,
``stall_after_headers``, ``drop``, ``endless``, ``sse``...).
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httptools

from handoff.protocol.control import CONTROL_ROUTES, NODE_STATE_HEADER


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Exchange:
    """One request on a fake node and the means to answer it, byte by byte if needed."""

    def __init__(self, conn: _ServerConn, request: Recorded) -> None:
        self.conn = conn
        self.request = request

    @property
    def is_closed(self) -> bool:
        return self.conn.transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.conn.transport.is_closing():
            self.conn.transport.write(data)

    def respond(self, status: int, body: bytes | Any = b"", *, content_type: str = "application/json",
                headers: dict[str, str] | None = None) -> None:
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        headers = dict(headers or {})
        node = self.conn.node
        if node.is_sidecar and node.sends_state_header and self.request.path in CONTROL_ROUTES:
            headers.setdefault(NODE_STATE_HEADER, json.dumps(node.state, separators=(",", ":")))
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.write(f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                   f"{extra}\r\n".encode() + body)

    def start_chunked(self, status: int = 200, content_type: str = "text/event-stream") -> None:
        self.write(f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n".encode())

    def chunk(self, data: bytes) -> None:
        self.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_chunked(self) -> None:
        self.write(b"0\r\n\r\n")

    async def wait_closed(self) -> None:
        await self.conn.closed.wait()

    def abort(self) -> None:
        self.conn.transport.abort()


Handler = Callable[["FakeNode", Exchange], Awaitable[None]]


class _ServerConn(asyncio.Protocol):
    def __init__(self, node: FakeNode) -> None:
        self.node = node
        self.parser = httptools.HttpRequestParser(self)
        self.closed = asyncio.Event()
        self.transport: asyncio.Transport
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.node.num_connections += 1
        self.node.conns.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.node.conns.discard(self)
        self.closed.set()
        if self._task is not None and not self._task.done():
            self.node.num_disconnects += 1
            self.node.disconnected.set()

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        parsed = httptools.parse_url(self._url)
        request = Recorded(self.parser.get_method().decode(), parsed.path.decode(),
                           (parsed.query or b"").decode(), self._headers, b"".join(self._body))
        self.node.requests.append(request)
        self._task = asyncio.ensure_future(self.node.dispatch(Exchange(self, request)))


def sidecar_state(*, serving: bool = True, admission: str = "open", tag_state: str = "resident",
                  weight_version: str = "default") -> dict[str, Any]:
    return {
        "role": "mixed", "serving": serving, "admission": admission, "engine_reachable": True,
        "tags": {tag: {"state": tag_state, "bytes": 1000 if tag_state == "resident" else 0}
                 for tag in ("weights", "kv_cache", "cuda_graph", "workspace")},
        "weights_valid": True, "weight_version": weight_version,
        "device": {"type": "cpu", "free_bytes": 1, "total_bytes": 2}, "process_rss_bytes": 123,
        "in_flight": 0, "held": 0,
    }


class FakeNode:
    """One fake node on its own port. Attributes may be changed from the test thread."""

    def __init__(self, cluster: FakeCluster, *, is_sidecar: bool = True, host: str = "127.0.0.1",
                 sends_state_header: bool = True) -> None:
        self.cluster = cluster
        self.host = host
        self.is_sidecar = is_sidecar
        self.sends_state_header = sends_state_header  # a sidecar's control answers carry its state
        self.state = sidecar_state()
        self.handlers: dict[str, Handler] = {}
        self.requests: list[Recorded] = []
        self.num_connections = 0
        self.num_disconnects = 0
        self.disconnected = threading.Event()
        self.conns: set[_ServerConn] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def requests_to(self, path: str) -> list[Recorded]:
        return [r for r in list(self.requests) if r.path == path]

    def set_released(self, is_released: bool = True) -> None:
        self.state = sidecar_state(serving=not is_released, admission="closed" if is_released else "open",
                                   tag_state="released" if is_released else "resident")

    def stop(self) -> None:
        """Stop listening and reset every open connection: from now on connections are refused."""
        async def stop() -> None:
            if self.server is not None:
                self.server.close()
            for conn in list(self.conns):
                conn.transport.abort()
        self.cluster.call(stop())

    async def dispatch(self, exchange: Exchange) -> None:
        handler = self.handlers.get(exchange.request.path)
        await (handler or _default_handler)(self, exchange)


async def _default_handler(node: FakeNode, ex: Exchange) -> None:
    path = ex.request.path
    if path == "/memory_occupation":
        ex.respond(200, node.state) if node.is_sidecar else ex.respond(404, {"detail": "Not Found"})
    elif path == "/health":
        ex.respond(200, {"status": "ok"})
    elif path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        await _generate(node, ex)
    elif path == "/release_memory_occupation":
        node.set_released(True)
        ex.respond(200, {"success": True, "released": ["weights"], "node": node.url})
    elif path == "/resume_memory_occupation":
        node.set_released(False)
        ex.respond(200, {"success": True, "resumed": ["weights"], "node": node.url})
    elif path == "/v1/models" or path.startswith("/v1/models/"):  # the LB relays only a model list or card
        card = {"id": path.removeprefix("/v1/models/") if path != "/v1/models" else "fake", "object": "model"}
        ex.respond(200, card if path != "/v1/models" else {"object": "list", "data": [card]})
    else:
        ex.respond(200, {"success": True, "path": path, "node": node.url})


async def _generate(node: FakeNode, ex: Exchange) -> None:
    if node.is_sidecar and not node.state["serving"]:
        ex.respond(503, {"error": {"type": "node_released", "message": "released"}}, headers={"Retry-After": "1"})
        return
    payload = ex.request.json() if ex.request.body else {}
    if payload.get("stream"):
        ex.start_chunked()
        for i in range(3):
            ex.chunk(b'data: {"text": "t%d", "node": "%s"}\n\n' % (i, node.url.encode()))
        ex.chunk(b"data: [DONE]\n\n")
        ex.end_chunked()
    else:
        ex.respond(200, {"text": "hello", "node": node.url, "meta_info": {"finish_reason": "stop"}})


class FakeCluster:
    """A background event loop that hosts fake nodes; use as a context manager."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-nodes", daemon=True)
        self.nodes: list[FakeNode] = []

    def __enter__(self) -> FakeCluster:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    def call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def start(self, count: int = 1, *, port: int = 0, **kwargs: Any) -> list[FakeNode]:
        """``count`` nodes; ``host`` (a loopback address) and ``port`` pin where they listen."""
        nodes = self.call(self._start(count, port, kwargs))
        self.nodes.extend(nodes)
        return nodes

    def start_one(self, **kwargs: Any) -> FakeNode:
        return self.start(1, **kwargs)[0]

    async def _start(self, count: int, port: int, kwargs: dict[str, Any]) -> list[FakeNode]:
        nodes = []
        for _ in range(count):
            node = FakeNode(self, **kwargs)
            node.server = await self.loop.create_server(lambda n=node: _ServerConn(n), node.host, port,
                                                        backlog=1024)
            node.port = node.server.sockets[0].getsockname()[1]
            nodes.append(node)
        return nodes

    async def _close_all(self) -> None:
        for node in self.nodes:
            if node.server is not None:
                node.server.close()
        for task in asyncio.all_tasks(self.loop):
            if task is not asyncio.current_task():
                task.cancel()

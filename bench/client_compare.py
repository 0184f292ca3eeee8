"""CPU per proxied request: the project's upstream client against aiohttp and httpx, in the same run.

    .venv/bin/pip install -e '.[bench]'     # aiohttp (httpx is a dependency already)
    .venv/bin/python bench/client_compare.py [--requests 4000] [--concurrency 32] [--repeat 5]

A fast fake node (``bench.lb_nodes``'s: a raw asyncio server, answering at
once) stands behind one proxy process per client: uvicorn (uvloop, httptools)
running the same raw ASGI app, which reads the request, POSTs it to the node
with the client under test (one pooled client per process) and answers with the
node's status, type and body: read whole for JSON, relayed chunk by chunk for a
stream of 16 SSE events written 1 ms apart (each event crosses the proxy on its
own, as a generation's tokens do; events written at once would coalesce in
the socket buffers differently from run to run and client to client). A fourth
proxy answers by itself, without a node, with the same bytes and the same
sends (the events 1 ms apart): the cost of uvicorn, the ASGI app and relaying,
which every client pays alike. This process is the load generator.

Each figure is the proxy process's CPU (user + system, psutil) over
``--requests`` requests, divided by their number; the cases rotate through the
proxies ``--repeat`` times and the median is printed, with each library's CPU
per request as a multiple of this client's, whole (what the process pays) and
with the no-node proxy's CPU taken off (what the client itself costs).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing
import platform
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import MAX_ANSWER_BYTES, JSON_HEADERS, call, timed_calls  # noqa: E402
from bench.lb_bench import REQUEST, STREAM_REQUEST  # noqa: E402
from bench.lb_nodes import NUM_STREAM_CHUNKS, FakeNodes, NodeSpec  # noqa: E402
from handoff.service.upstream import UpstreamClient, UpstreamError  # noqa: E402

CLIENTS = ("handoff", "aiohttp", "httpx")
Send = Callable[[dict[str, Any]], Awaitable[None]]


# -- the relays: one per client, each the way its documentation says to stream a response --------
class HandoffRelay:
    def __init__(self) -> None:
        self.client = UpstreamClient()

    async def relay(self, url: str, body: bytes, send: Send) -> None:
        async with await self.client.request("POST", url, headers=JSON_HEADERS, body=body, timeout=30) as response:
            await send(_start(response.status, response.content_type))
            if response.content_type.startswith("text/event-stream"):
                async for chunk in response.aiter_bytes():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body"})
            else:
                await send({"type": "http.response.body", "body": await response.read_whole(MAX_ANSWER_BYTES)})

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpRelay:
    def __init__(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=30), auto_decompress=False)

    async def relay(self, url: str, body: bytes, send: Send) -> None:
        async with self.session.post(url, data=body, headers=JSON_HEADERS) as response:
            content_type = response.headers.get("content-type", "")
            await send(_start(response.status, content_type))
            if content_type.startswith("text/event-stream"):
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body"})
            else:
                await send({"type": "http.response.body", "body": await response.read()})

    async def aclose(self) -> None:
        await self.session.close()


class HttpxRelay:
    def __init__(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None,
                                                                        max_keepalive_connections=256))

    async def relay(self, url: str, body: bytes, send: Send) -> None:
        async with self.client.stream("POST", url, content=body, headers=JSON_HEADERS) as response:
            content_type = response.headers.get("content-type", "")
            await send(_start(response.status_code, content_type))
            if content_type.startswith("text/event-stream"):
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body"})
            else:
                await send({"type": "http.response.body", "body": await response.aread()})

    async def aclose(self) -> None:
        await self.client.aclose()


RELAYS = {"handoff": HandoffRelay, "aiohttp": AiohttpRelay, "httpx": HttpxRelay}
NO_NODE_ANSWER = REQUEST  # the no-node proxy answers bytes of a generation answer's size
# ... and for a stream, the events a node sends, as paced as the node's (bench.lb_nodes's decode_paced)
NO_NODE_EVENTS = [b'data: {"text": "token %d", "meta_info": {"completion_tokens": %d}}\n\n' % (i, i + 1)
                  for i in range(NUM_STREAM_CHUNKS)] + [b"data: [DONE]\n\n"]


async def answer_without_node(body: bytes, send: Send) -> None:
    """What the proxy sends when there is no node: the same bytes and, for a stream, the same sends."""
    if b'"stream": true' not in body:
        await send(_start(200, "application/json"))
        await send({"type": "http.response.body", "body": NO_NODE_ANSWER})
        return
    await send(_start(200, "text/event-stream"))
    for index, event in enumerate(NO_NODE_EVENTS):
        if index:
            await asyncio.sleep(0.001)
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body"})


def _start(status: int, content_type: str) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", content_type.encode("latin-1"))]}


def make_app(kind: str, node_url: str) -> Callable[..., Awaitable[None]]:
    """The proxy: ``kind`` names the relay, or ``"none"`` for answering without a node."""
    relay: Any = None

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], send: Send) -> None:
        nonlocal relay
        if scope["type"] == "lifespan":
            await receive()  # startup: the relay's client needs the running loop
            relay = RELAYS[kind]() if kind in RELAYS else None
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            if relay is not None:
                await relay.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if relay is None:
            await answer_without_node(body, send)
            return
        await relay.relay(node_url + scope["path"], body, send)

    return app


def serve_proxy(kind: str, node_url: str, conn: Any) -> None:
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    conn.send(sock.getsockname()[1])
    config = uvicorn.Config(make_app(kind, node_url), loop="uvloop", http="httptools", lifespan="on",
                            log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


# -- measuring -------------------------------------------------------------------------------------
class Proxy:
    def __init__(self, kind: str, node_url: str) -> None:
        self.kind = kind
        parent, child = multiprocessing.Pipe()
        self.process = multiprocessing.Process(target=serve_proxy, args=(kind, node_url, child), daemon=True)
        self.process.start()
        if not parent.poll(60):
            raise RuntimeError(f"the {kind} proxy did not start")
        self.url = f"http://127.0.0.1:{parent.recv()}"

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(10)


async def wait_ready(client: UpstreamClient, proxy: Proxy) -> None:
    for _ in range(500):
        try:
            await call(client, "POST", proxy.url + "/generate", REQUEST, timeout=5)
            return
        except (UpstreamError, RuntimeError):  # not listening, or not ready: poll until the deadline
            await asyncio.sleep(0.02)
    raise RuntimeError(f"the {proxy.kind} proxy does not answer")


async def measure(client: UpstreamClient, proxy: Proxy, body: bytes, num_requests: int,
                  concurrency: int) -> tuple[float, float]:
    """(proxy CPU microseconds per request, p50 latency in ms)."""
    async def one() -> None:
        await call(client, "POST", proxy.url + "/generate", body, timeout=30)

    await timed_calls(one, max(200, num_requests // 10), concurrency)  # warm-up: connections, caches
    cpu_before = proxy.cpu_seconds()
    latencies = await timed_calls(one, num_requests, concurrency)
    return (proxy.cpu_seconds() - cpu_before) / num_requests * 1e6, statistics.median(latencies) * 1000


# (node, request body, requests per measurement as a share of --requests)
CASES = {"JSON answer, read whole": ("decode", REQUEST, 1.0),
         "16 SSE events 1 ms apart, relayed": ("decode_paced", STREAM_REQUEST, 0.25)}


async def run(args: argparse.Namespace, node_urls: dict[str, str]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    client = UpstreamClient()
    proxies = {(node, kind): Proxy(kind, url) for node, url in node_urls.items() for kind in ("none", *CLIENTS)}
    try:
        for proxy in proxies.values():
            await wait_ready(client, proxy)
        for case, (node, body, _) in CASES.items():  # each relay answers with the node's bytes
            direct = await call(client, "POST", node_urls[node] + "/generate", body)
            for kind in CLIENTS:
                if await call(client, "POST", proxies[(node, kind)].url + "/generate", body) != direct:
                    raise RuntimeError(f"the {kind} proxy changed the node's answer ({case})")
        figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.repeat):  # rotated, so every proxy sees the same machine
            for case, (node, body, share) in CASES.items():
                for kind in ("none", *CLIENTS):
                    figures.setdefault((case, kind), []).append(await measure(
                        client, proxies[(node, kind)], body, int(args.requests * share), args.concurrency))
        return figures
    finally:
        for proxy in proxies.values():
            proxy.stop()
        await client.aclose()


def report(figures: dict[tuple[str, str], list[tuple[float, float]]], args: argparse.Namespace) -> None:
    import aiohttp
    import httpx
    import uvicorn

    print(f"client_compare {datetime.date.today()}: {platform.node()}, {psutil.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
          f"aiohttp {aiohttp.__version__}, httpx {httpx.__version__}, uvicorn {uvicorn.__version__}; "
          f"{args.requests} requests x {args.repeat}, {args.concurrency} in flight")
    header = (f"| {'case':<34} | {'proxy':<8} | {'CPU/request':>11} | {'minus no-node':>13} | {'p50':>8} "
              f"| {'x handoff':>9} | {'x handoff, client only':>22} |")
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for case in CASES:
        median = {kind: (statistics.median(c for c, _ in figures[(case, kind)]),
                         statistics.median(p for _, p in figures[(case, kind)])) for kind in ("none", *CLIENTS)}
        floor = median["none"][0]
        ours = median["handoff"][0]
        for kind in ("none", *CLIENTS):
            cpu, p50 = median[kind]
            whole = f"{cpu / ours:.2f}" if kind != "none" else "-"
            client_only = _ratio(cpu - floor, ours - floor) if kind != "none" else "-"
            print(f"| {case:<34} | {kind:<8} | {cpu:>8.0f} us | {cpu - floor:>10.0f} us | {p50:>5.2f} ms "
                  f"| {whole:>9} | {client_only:>22} |")
        best = min(CLIENTS[1:], key=lambda kind: median[kind][0])
        print(f"{case}: the best library ({best}) uses {median[best][0] / ours:.2f}x the CPU per request of "
              f"handoff's client (counting the clients alone: {_ratio(median[best][0] - floor, ours - floor)})")


def _ratio(numerator: float, denominator: float) -> str:
    """``numerator / denominator``, or "n/a" when too few requests left the clock at the floor."""
    return f"{numerator / denominator:.2f}" if denominator > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--repeat", type=int, default=5, help="rotations through the proxies; figures are medians")
    args = parser.parse_args()
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        sys.exit("aiohttp is missing: pip install -e '.[bench]'")
    node_kinds = ["decode", "decode_paced"]
    with FakeNodes([NodeSpec(kind) for kind in node_kinds]) as nodes:
        node_urls = dict(zip(node_kinds, nodes.urls))
        import uvloop

        figures = uvloop.run(run(args, node_urls))
    report(figures, args)


if __name__ == "__main__":
    main()

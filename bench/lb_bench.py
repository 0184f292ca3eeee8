"""Benchmark of the load balancer (issue 5), each figure beside the same calls made directly.

    .venv/bin/python bench/lb_bench.py [--requests 3000] [--rounds 60] [--concurrency 8] [--repeat 3]

Fake nodes (a separate process, uvloop + httptools, answering at once) stand
behind a real ``python -m lb`` process; this process is the client. Measured:

- LB CPU (user + system of the LB process, psutil) per proxied ``/generate``
  through a prefill + decode pair, non-stream and streamed: the decode node
  writes 16 SSE chunks at once (an instant node, the case the target is for),
  or 1 ms apart (each chunk then crosses the LB on its own); beside it, the
  latency of the same two calls made by the client to the nodes directly.
- Fan-out overhead: p50 of ``POST /flush_cache`` through the LB to 128 nodes
  (answering at once, or after 20 ms) minus p50 of the same 128 calls made
  directly by the client in parallel, over the same pooled client code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import httptools

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import call, cpu_seconds, start_server, timed_calls  # noqa: E402
from handoff.cluster.process import ServerProcess  # noqa: E402
from handoff.service.upstream import UpstreamClient  # noqa: E402

NUM_FANOUT_NODES = 128
NUM_STREAM_CHUNKS = 16
SIDECAR_STATE = json.dumps({"role": "mixed", "serving": True, "admission": "open", "weights_valid": True,
                            "tags": {t: {"state": "resident", "bytes": 1} for t in
                                     ("weights", "kv_cache", "cuda_graph", "workspace")}}).encode()
DECODE_ANSWER = json.dumps({"text": "a short completion of a few words", "output_ids": list(range(16)),
                            "meta_info": {"prompt_tokens": 12, "completion_tokens": 16, "finish_reason": "stop",
                                          "weight_version": "default"}}).encode()
PREFILL_ANSWER = json.dumps({"text": "", "meta_info": {"prompt_tokens": 12}}).encode()
REQUEST = json.dumps({"text": "The quick brown fox jumps over the lazy dog", "sampling_params":
                      {"max_new_tokens": 16, "temperature": 0}}).encode()
STREAM_REQUEST = json.dumps({**json.loads(REQUEST), "stream": True}).encode()


# -- fake nodes (separate process) -----------------------------------------------------

class _NodeProtocol(asyncio.Protocol):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.parser = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()
        self.url = b""
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path = self.url.split(b"?")[0]
        if path == b"/memory_occupation":
            self._json(SIDECAR_STATE)
        elif path == b"/generate":
            is_stream = b'"stream": true' in self.body
            if self.mode.startswith("decode"):
                self._stream(NUM_STREAM_CHUNKS) if is_stream else self._json(DECODE_ANSWER)
            else:
                self._stream(1) if is_stream else self._json(PREFILL_ANSWER)
        elif self.mode == "slow":
            self.loop.call_later(0.02, self._json, b'{"success": true}')
        else:
            self._json(b'{"success": true}')

    def _json(self, body: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))

    def _stream(self, num_chunks: int) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        self._chunk(0, num_chunks)

    def _chunk(self, index: int, num_chunks: int) -> None:
        if self.transport.is_closing():
            return
        if index == num_chunks:
            self.transport.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            return
        event = b'data: {"text": "token %d", "meta_info": {"completion_tokens": %d}}\n\n' % (index, index + 1)
        self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))  # one write per chunk
        if self.mode == "decode_paced":
            self.loop.call_later(0.001, self._chunk, index + 1, num_chunks)
        else:
            self._chunk(index + 1, num_chunks)


def serve_nodes(modes: list[str], conn: Any) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ports = []
        for mode in modes:
            server = await loop.create_server(lambda m=mode: _NodeProtocol(m), "127.0.0.1", 0, backlog=1024)
            ports.append(server.sockets[0].getsockname()[1])
        conn.send(ports)
        await loop.run_in_executor(None, conn.recv)  # until the parent says stop

    uvloop.run(main())


# -- the LB process ---------------------------------------------------------------------

def start_lb(args: list[str]) -> ServerProcess:
    return start_server("lb", [*args, "--log-level", "warning", "--health-interval", "60"], "lb")


# -- measuring ----------------------------------------------------------------------------

async def read_all(client: UpstreamClient, method: str, url: str, body: bytes = b"") -> bytes:
    return await call(client, method, url, body, timeout=30)


def p50_ms(latencies: list[float]) -> float:
    return statistics.median(latencies) * 1000


async def bench_generate(client: UpstreamClient, lb: ServerProcess, prefill: str, decode: str, body: bytes,
                         num_requests: int, concurrency: int) -> dict[str, float]:
    expected = (await read_all(client, "POST", decode + "/generate", body))

    async def through_lb() -> None:
        if await read_all(client, "POST", lb.url + "/generate", body) != expected:
            raise RuntimeError("the LB did not answer with the decode node's bytes")

    async def direct() -> None:
        await asyncio.gather(read_all(client, "POST", prefill + "/generate", body),
                             read_all(client, "POST", decode + "/generate", body))

    await timed_calls(through_lb, 300, concurrency)  # warm-up: connections, caches
    cpu_before = cpu_seconds(lb)
    latencies = await timed_calls(through_lb, num_requests, concurrency)
    cpu_ms = (cpu_seconds(lb) - cpu_before) / num_requests * 1000
    await timed_calls(direct, 300, concurrency)
    direct_latencies = await timed_calls(direct, num_requests, concurrency)
    return {"cpu_ms": cpu_ms, "lb_p50": p50_ms(latencies), "direct_p50": p50_ms(direct_latencies)}


async def bench_fanout(client: UpstreamClient, lb: ServerProcess, urls: list[str], role: str,
                       num_rounds: int) -> dict[str, float]:
    async def through_lb() -> None:
        answer = json.loads(await read_all(client, "POST", f"{lb.url}/flush_cache?role={role}"))
        if answer["total"] != len(urls):
            raise RuntimeError(f"fan-out reached {answer['total']} nodes, not {len(urls)}")

    async def direct() -> None:
        await asyncio.gather(*(read_all(client, "POST", url + "/flush_cache") for url in urls))

    await timed_calls(through_lb, 5, 1)
    await timed_calls(direct, 5, 1)
    lb_latencies, direct_latencies = [], []
    cpu_before = cpu_seconds(lb)
    for _ in range(num_rounds):  # interleaved, so both see the same machine
        lb_latencies += await timed_calls(through_lb, 1, 1)
        direct_latencies += await timed_calls(direct, 1, 1)
    cpu_ms = (cpu_seconds(lb) - cpu_before) / num_rounds * 1000
    lb_p50, direct_p50 = p50_ms(lb_latencies), p50_ms(direct_latencies)
    return {"cpu_ms": cpu_ms, "lb_p50": lb_p50, "direct_p50": direct_p50, "overhead_p50": lb_p50 - direct_p50}


async def repeated(times: int, measure: Callable[[], Awaitable[dict[str, float]]]) -> dict[str, float]:
    """Each figure is the median over ``times`` runs: the box is shared, one run can catch a neighbour."""
    runs = [await measure() for _ in range(times)]
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


async def run(args: argparse.Namespace, ports: list[int]) -> list[tuple[str, dict[str, float], str]]:
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    prefill, decode, decode_paced = urls[0], urls[1], urls[2]
    instant, slow = urls[3:3 + NUM_FANOUT_NODES], urls[3 + NUM_FANOUT_NODES:]
    rows = []
    client = UpstreamClient()
    lb = start_lb(["--prefill", f"{prefill}@8998", "--decode", decode])
    try:
        rows.append(("PD /generate, non-stream", await repeated(args.repeat, lambda: bench_generate(
            client, lb, prefill, decode, REQUEST, args.requests, args.concurrency)), "CPU <= 0.25 ms"))
        rows.append((f"PD /generate, stream of {NUM_STREAM_CHUNKS} chunks", await repeated(
            args.repeat, lambda: bench_generate(client, lb, prefill, decode, STREAM_REQUEST, args.requests,
                                                args.concurrency)), "CPU <= 0.45 ms"))
    finally:
        lb.stop()
    lb = start_lb(["--prefill", f"{prefill}@8998", "--decode", decode_paced])
    try:
        rows.append(("PD /generate, stream, chunks 1 ms apart", await repeated(args.repeat, lambda: bench_generate(
            client, lb, prefill, decode_paced, STREAM_REQUEST, args.requests // 2, args.concurrency)), "-"))
    finally:
        lb.stop()
    node_args = [a for url in instant for a in ("--node", url)] + [a for url in slow for a in ("--decode", url)]
    lb = start_lb(node_args)
    try:
        rows.append((f"fan-out to {NUM_FANOUT_NODES} instant nodes", await repeated(
            args.repeat, lambda: bench_fanout(client, lb, instant, "mixed", args.rounds)), "overhead p50 <= 6 ms"))
        rows.append((f"fan-out to {NUM_FANOUT_NODES} nodes answering in 20 ms", await repeated(
            args.repeat, lambda: bench_fanout(client, lb, slow, "decode", args.rounds)), "overhead p50 <= 10 ms"))
    finally:
        lb.stop()
        await client.aclose()
    return rows


def print_table(rows: list[tuple[str, dict[str, float], str]]) -> None:
    header = f"| {'case':<42} | {'LB CPU/call':>11} | {'LB p50':>8} | {'direct p50':>10} | {'overhead p50':>12} | target |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for name, row, target in rows:
        overhead = row.get("overhead_p50", row["lb_p50"] - row["direct_p50"])
        print(f"| {name:<42} | {row['cpu_ms']:>8.3f} ms | {row['lb_p50']:>5.2f} ms | {row['direct_p50']:>7.2f} ms "
              f"| {overhead:>9.2f} ms | {target} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="generation requests per case")
    parser.add_argument("--rounds", type=int, default=60, help="fan-out rounds per case")
    parser.add_argument("--concurrency", type=int, default=8, help="generation requests in flight at once")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; each figure is their median")
    args = parser.parse_args()
    modes = ["prefill", "decode", "decode_paced"] + ["instant"] * NUM_FANOUT_NODES + ["slow"] * NUM_FANOUT_NODES
    parent, child = multiprocessing.Pipe()
    nodes = multiprocessing.Process(target=serve_nodes, args=(modes, child), daemon=True)
    nodes.start()
    try:
        ports = parent.recv()
        import uvloop

        rows = uvloop.run(run(args, ports))
    finally:
        parent.send("stop")
        nodes.join(10)
    print_table(rows)


if __name__ == "__main__":
    main()

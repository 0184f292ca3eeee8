"""The floor of a fan-out written in Python: what 128 requests and their answers cost with nothing else done.

    .venv/bin/python bench/fanout_floor.py [--nodes 128] [--rounds 400]

The same fake nodes as ``bench/lb_bench.py`` (``bench/lb_nodes.py``, one
process), called by this process through bare uvloop protocols: one kept-alive
connection per node, one write of a prebuilt release request each, an answer
counted complete by its ``Content-Length``, nothing parsed, judged or encoded.
Printed: p50 of one round (every node answered) and this process's CPU per
round. The LB's own fan-out (``bench/lb_bench.py --cases fanout``) does
everything this skips; the gap between the two is what its Python costs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import uvloop

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.lb_nodes import FakeNodes, NodeSpec  # noqa: E402

BODY = b'{"tags": ["weights", "kv_cache"]}'
REQUEST = (b"POST /release_memory_occupation HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
WARMUP_ROUNDS = 50


class _BareConnection(asyncio.Protocol):
    """Counts an answer complete once its head and ``Content-Length`` bytes are in; nothing else."""

    def __init__(self) -> None:
        self.buffer = b""
        self.answered: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buffer[:head_end].lower()
        at = head.find(b"content-length:") + len(b"content-length:")
        length = int(head[at:].split(b"\r\n", 1)[0])
        if len(self.buffer) >= head_end + 4 + length and self.answered is not None:
            self.buffer = b""
            self.answered.set_result(None)

    def send(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        self.answered = loop.create_future()
        self.transport.write(REQUEST)
        return self.answered


async def measure(urls: list[str], rounds: int) -> tuple[float, float]:
    """(p50 seconds of one round, CPU seconds of this process per round)."""
    loop = asyncio.get_running_loop()
    connections = []
    for url in urls:
        port = int(url.rsplit(":", 1)[1])
        _, connection = await loop.create_connection(_BareConnection, "127.0.0.1", port)
        connections.append(connection)
    latencies = []
    cpu_started = 0.0
    for index in range(WARMUP_ROUNDS + rounds):
        if index == WARMUP_ROUNDS:
            cpu_started = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*[connection.send(loop) for connection in connections])
        if index >= WARMUP_ROUNDS:
            latencies.append(time.perf_counter() - started)
    cpu_per_round = (time.process_time() - cpu_started) / rounds
    for connection in connections:
        connection.transport.close()
    return statistics.median(latencies), cpu_per_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    with FakeNodes([NodeSpec("instant")] * args.nodes) as nodes:
        p50, cpu = uvloop.run(measure(nodes.urls, args.rounds))
    print(f"bare fan-out to {args.nodes} instant nodes, {args.rounds} rounds: p50 {p50 * 1000:.2f} ms, "
          f"CPU {cpu * 1000:.2f} ms per round ({cpu / args.nodes * 1e6:.0f} us per node)")


if __name__ == "__main__":
    main()

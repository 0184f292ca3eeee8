"""Measuring helpers shared by the benchmark scripts."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import psutil

from handoff.cluster.process import ServerProcess
from handoff.service.upstream import UpstreamClient

REPO_ROOT = Path(__file__).resolve().parents[1]

JSON_HEADERS = {"Content-Type": "application/json"}
MAX_ANSWER_BYTES = 256 * 1024 * 1024  # the benchmarks' cap on one buffered answer

# The engine benchmarks' models: ``builtin:tiny`` with these shape overrides. "100m" has ~104M parameters
# (vocabulary 320: the byte tokenizer's, so the LM head is negligible).
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "100m": {"hidden_size": 768, "intermediate_size": 3072, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4,
             "head_dim": 64},
}


async def call(client: UpstreamClient, method: str, url: str, body: bytes = b"", *, expect: int = 200,
               timeout: float = 60) -> bytes:
    """One request, read to the end; raises unless the status is ``expect``."""
    response = await client.request(method, url, headers=JSON_HEADERS if body else None, body=body, timeout=timeout)
    data = await response.read_whole(MAX_ANSWER_BYTES)
    if response.status != expect:
        raise RuntimeError(f"{method} {url} answered {response.status}: {data[:300]!r}")
    return data


async def timed_calls(one: Callable[[], Awaitable[Any]], num_calls: int, concurrency: int) -> list[float]:
    """``num_calls`` calls of ``one``, ``concurrency`` at a time; each call's latency in seconds."""
    latencies: list[float] = []
    remaining = num_calls

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def start_server(module: str, args: list[str], name: str) -> ServerProcess:
    """A project server (``python -m module``) on a free loopback port, healthy when this returns."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    return ServerProcess(module, args, log_dir=log_dir, name=name, cwd=REPO_ROOT).start(timeout=120)


def cpu_seconds(server: ServerProcess) -> float:
    """User + system CPU seconds the server's process has used so far."""
    times = psutil.Process(server.pid).cpu_times()
    return times.user + times.system


def median_s(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``run``, in seconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)

"""Measuring helpers shared by the benchmark scripts."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from handoff.service.upstream import UpstreamClient

JSON_HEADERS = {"Content-Type": "application/json"}


async def call(client: UpstreamClient, method: str, url: str, body: bytes = b"", *, expect: int = 200,
               timeout: float = 60) -> bytes:
    """One request, read to the end; raises unless the status is ``expect``."""
    response = await client.request(method, url, headers=JSON_HEADERS if body else None, body=body, timeout=timeout)
    data = await response.read()
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

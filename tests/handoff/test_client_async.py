"""The asyncio client's lifetime and pool: one event loop per client, said clearly; concurrent calls in flight
together; a call cancelled mid-retry leaves nothing running."""

from __future__ import annotations

import asyncio

import pytest

from handoff.client import AsyncHandoffClient, HandoffClient, RetryPolicy
from tests.handoff.scripted import UNAVAILABLE, received, script


def test_a_client_used_on_a_second_event_loop_says_so_and_sends_nothing(server) -> None:
    client = AsyncHandoffClient(server.url, timeout=30)
    script(server)
    assert asyncio.run(client.generate("hi")) == {"ok": True}
    sent = len(received(server))
    for _ in range(2):  # a pooled connection of the first loop would fail with "Event loop is closed"
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(client.generate("hi"))

    async def stream() -> None:
        async for _ in client.stream_generate("hi"):
            pass

    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(stream())
    assert len(received(server)) == sent


@pytest.mark.parametrize("make", ["async", "sync"])
def test_more_calls_than_httpxs_default_pool_are_in_flight_together(server, make: str) -> None:
    count = 150  # httpx's default pool holds 100 connections: the rest would wait for one, timing out
    script(server, *[{"gather": count}] * count)
    if make == "async":
        async def calls() -> list:
            async with AsyncHandoffClient(server.url, timeout=60) as client:
                return await asyncio.gather(*(client.generate("hi") for _ in range(count)))
        answers = asyncio.run(calls())
    else:
        from concurrent.futures import ThreadPoolExecutor
        with HandoffClient(server.url, timeout=60) as client, ThreadPoolExecutor(count) as pool:
            answers = list(pool.map(lambda _: client.generate("hi"), range(count)))
    assert [answer["gathered"] for answer in answers] == [count] * count


@pytest.mark.parametrize("value", [0, -1, True, 2.5])
def test_a_pool_without_a_connection_is_refused(value: object) -> None:
    for make in (HandoffClient, AsyncHandoffClient):
        with pytest.raises(ValueError, match="max_connections"):
            make("http://127.0.0.1:1", max_connections=value)  # type: ignore[arg-type]


def test_a_call_cancelled_while_it_waits_to_retry_stops(server) -> None:
    script(server)
    before = len(received(server))

    async def cancelled() -> None:
        async with AsyncHandoffClient(server.url, timeout=60,
                                      retry=RetryPolicy(max_attempts=5, max_wait_s=60)) as client:
            script(server, *[{**UNAVAILABLE, "headers": {"Retry-After": "0.5"}}] * 5)
            task = asyncio.create_task(client.generate("hi"))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while len(received(server)) == before and loop.time() < deadline:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(1.5)  # three retries' time: none is sent
            assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []

    asyncio.run(cancelled())
    assert len(received(server)) - before == 1


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1024"])
def test_an_answer_cap_that_takes_no_answer_is_refused(value: object) -> None:
    for make in (HandoffClient, AsyncHandoffClient):
        with pytest.raises(ValueError, match="max_answer_bytes"):
            make("http://127.0.0.1:1", max_answer_bytes=value)  # type: ignore[arg-type]

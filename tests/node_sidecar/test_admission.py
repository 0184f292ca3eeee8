"""Admission on its own: counting, drains that wake at once, the bounded hold queue."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest

from handoff.service.errors import Unavailable
from node_sidecar.admission import Admission


def make(hold_max: int | None = None, hold_timeout: float = 5.0) -> Admission:
    return Admission(hold_max=hold_max, hold_timeout=hold_timeout,
                     refuse=lambda: Unavailable("closed", type="node_released", retry_after=1))


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Yield to the loop until ``predicate`` holds; TimeoutError past the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0)


async def test_closed_refuses_without_hold() -> None:
    a = make()
    with pytest.raises(Unavailable):
        await a.enter()
    a.open()
    await a.enter()
    assert a.num_in_flight == 1


async def test_drain_wakes_when_the_last_request_leaves() -> None:
    a = make()
    a.open()
    first = await a.enter()
    second = await a.enter()
    a.close()
    drain = asyncio.create_task(a.drain(10))
    await asyncio.sleep(0)
    first.release()
    first.release()  # a lease is given back once, however often it is released
    await asyncio.sleep(0)
    assert not drain.done() and a.num_in_flight == 1
    second.release()
    assert await asyncio.wait_for(drain, 1) is True
    assert await a.drain(0.01) is True


async def test_drain_times_out() -> None:
    a = make()
    a.open()
    await a.enter()
    assert await a.drain(0.05) is False


async def test_held_requests_run_in_order_when_reopened() -> None:
    a = make(hold_max=3)
    order: list[int] = []

    async def request(n: int) -> None:
        await a.enter()
        order.append(n)

    tasks = [asyncio.create_task(request(n)) for n in range(3)]
    await until(lambda: a.num_held == 3)
    assert a.num_in_flight == 0
    with pytest.raises(Unavailable):
        await a.enter()  # the queue is full
    a.open()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and a.num_in_flight == 3


async def test_hold_timeout_and_cancelled_waiters_leave_no_trace() -> None:
    a = make(hold_max=5, hold_timeout=0.05)
    with pytest.raises(Unavailable):
        await a.enter()
    assert a.num_held == 0
    a.hold_timeout = 5
    waiter = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    a.open()
    assert a.num_in_flight == 0


async def test_refuse_held_answers_them_at_once() -> None:
    a = make(hold_max=5)
    waiter = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    a.refuse_held()
    with pytest.raises(Unavailable):
        await waiter
    assert a.num_in_flight == 0

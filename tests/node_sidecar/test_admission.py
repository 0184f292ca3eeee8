"""Admission on its own: counting, drains that wake at once, the bounded hold queue."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest

from handoff.service.errors import Unavailable
from node_sidecar.admission import Admission, HoldLimits

_LIMITS: dict[int, HoldLimits | None] = {}  # each admission's hold limits, which a test may change


def make(hold_max: int | None = None, hold_timeout: float = 5.0, max_bytes: int = 1 << 30) -> Admission:
    admission = Admission(refuse=lambda: Unavailable("closed", type="node_released", retry_after=1),
                          hold_limits=lambda: _LIMITS[id(admission)])
    set_limits(admission, None if hold_max is None else HoldLimits(hold_max, hold_timeout, max_bytes))
    return admission


def set_limits(admission: Admission, limits: HoldLimits | None) -> None:
    _LIMITS[id(admission)] = limits


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
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2] and a.num_in_flight == 3


async def test_hold_timeout_and_cancelled_waiters_leave_no_trace() -> None:
    a = make(hold_max=5, hold_timeout=0.05)
    with pytest.raises(Unavailable):
        await a.enter()
    assert a.num_held == 0
    set_limits(a, HoldLimits(5, 5.0, 1 << 30))
    waiter = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 5)
    a.open()
    assert a.num_in_flight == 0


async def test_refuse_held_answers_them_at_once() -> None:
    a = make(hold_max=5)
    waiter = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    a.refuse_held()
    with pytest.raises(Unavailable):
        await asyncio.wait_for(waiter, 5)
    assert a.num_in_flight == 0


async def test_a_client_leaving_as_it_is_admitted_is_not_counted() -> None:
    """Admitted and cancelled in the same loop tick: the request leaves, uncounted (it was sent on to the engine
    for a client that was gone, and counted until the engine finished)."""
    a = make(hold_max=4)
    held = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    a.open()
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(held, 5)
    assert a.num_in_flight == 0


async def test_a_refusal_in_the_same_tick_as_the_hold_deadline_is_a_refusal() -> None:
    """The hold timeout and a refusal (the engine went away) at once: a 503, never a lease that was not
    counted (releasing it raised, or lowered another request's count)."""
    for _ in range(5):
        a = make(hold_max=4, hold_timeout=0.05)
        held = asyncio.create_task(a.enter())
        await until(lambda: a.num_held == 1)
        asyncio.get_running_loop().call_later(0.05, a.refuse_held)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(held, 5)
        assert a.num_in_flight == 0


async def test_a_client_leaving_as_it_is_refused_leaves_the_others_counted() -> None:
    a = make(hold_max=4)
    a.open()
    running = a.try_enter()
    a.close()
    held = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    a.refuse_held()
    held.cancel()
    with pytest.raises((asyncio.CancelledError, Unavailable)):
        await asyncio.wait_for(held, 5)
    assert a.num_in_flight == 1  # the running request is still counted: a drain waits for it
    running.release()
    assert a.num_in_flight == 0


async def test_an_aborting_drain_aborts_again_for_a_request_that_reached_the_engine_late() -> None:
    """A request counted in flight but still on its way to the engine when the first abort arrived there runs
    on; the drain's next abort ends it (one abort left the release waiting for its whole length)."""
    a = make()
    a.open()
    lease = a.try_enter()
    num_aborts = 0

    async def abort() -> None:
        nonlocal num_aborts
        num_aborts += 1
        if num_aborts == 2:  # the request is in the engine now: this abort ends it
            lease.release()

    assert await a.drain(5.0, abort=abort) is True
    assert num_aborts == 2


async def test_an_aborting_drain_still_ends_at_its_deadline() -> None:
    a = make()
    a.open()
    a.try_enter()
    num_aborts = 0

    async def abort() -> None:
        nonlocal num_aborts
        num_aborts += 1

    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await a.drain(0.3, abort=abort) is False
    assert 0.29 <= loop.time() - started < 4 and num_aborts >= 2


async def test_held_bodies_are_bounded_in_bytes() -> None:
    a = make(hold_max=100, max_bytes=1000)
    first = asyncio.create_task(a.enter(num_bytes=600))
    await until(lambda: a.num_held == 1)
    with pytest.raises(Unavailable):
        await a.enter(num_bytes=600)  # 1200 bytes would wait: refused at once
    second = asyncio.create_task(a.enter(num_bytes=400))
    await until(lambda: a.num_held == 2 and a.held_bytes == 1000)
    a.open()
    for task in (first, second):
        (await asyncio.wait_for(task, 5)).release()
    assert a.num_in_flight == 0


async def test_held_requests_follow_the_limits_of_now() -> None:
    """A request held under a pause's long limits follows --hold-requests' short ones once the pause ends on a
    released node (it waited on, for up to the pause's hour); past the new count, the newest are refused."""
    a = make(hold_max=10, hold_timeout=3600)
    held = [asyncio.create_task(a.enter()) for _ in range(3)]
    await until(lambda: a.num_held == 3)
    set_limits(a, HoldLimits(2, 0.2, 1 << 30))
    a.reapply_limits()
    with pytest.raises(Unavailable):
        await asyncio.wait_for(held[2], 5)  # the newest, past the new count, at once
    loop = asyncio.get_running_loop()
    started = loop.time()
    for task in held[:2]:
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, 5)  # at the new timeout, counted from their arrival
    assert loop.time() - started < 3 and a.num_held == 0  # the new 0.2 s, not the pause's hour
    waiting = asyncio.create_task(a.enter())
    await until(lambda: a.num_held == 1)
    set_limits(a, None)
    a.reapply_limits()
    with pytest.raises(Unavailable):
        await asyncio.wait_for(waiting, 5)  # nothing may wait now: refused at once, free to go elsewhere


async def test_held_requests_that_leave_behind_one_still_waiting_leave_nothing_behind() -> None:
    """One request held, then 2000 more held and given up by their clients: the queue holds the one still waiting.
    Before the fix it was pruned only from its head, so every request that left behind a waiting one stayed in it
    (the queue grew without bound while the first waited: an hour in a pause) and every arrival scanned it whole
    to count the held requests and bytes (a sidecar churned 25,000 times answered /memory_occupation in 6.7 s)."""
    a = make(hold_max=4, max_bytes=100)
    anchor = asyncio.create_task(a.enter(num_bytes=10))
    await until(lambda: a.num_held == 1)
    for _ in range(2000):
        gone = asyncio.create_task(a.enter(num_bytes=10))
        await until(lambda: a.num_held == 2)
        gone.cancel()
        await until(lambda: gone.done() and a.num_held == 1)
    assert len(a._held) == 1 and a.held_bytes == 10
    refused = asyncio.create_task(a.enter(num_bytes=95))  # the bytes bound counts only the anchor's 10
    with pytest.raises(Unavailable):
        await asyncio.wait_for(refused, 5)
    a.open()
    await asyncio.wait_for(anchor, 5)
    assert a.num_in_flight == 1 and a.num_held == 0 and a.held_bytes == 0


async def test_an_aborting_drain_tells_the_requests_counted_how_to_cut_them_until_they_leave() -> None:
    """A request whose only holder is its client (a stream not read) is cut by an aborting drain's round; one
    released is no longer told, and a waiting drain tells none."""
    a = make()
    a.open()
    stuck, gone = a.try_enter(), a.try_enter()
    assert stuck is not None and gone is not None
    told: list[str] = []
    stuck.on_abort(lambda: (told.append("stuck"), stuck.release()))
    gone.on_abort(lambda: told.append("gone"))
    gone.release()
    assert await a.drain(5.0, abort=lambda: asyncio.sleep(0)) is True
    assert told == ["stuck"] and a.num_in_flight == 0
    waiting = a.try_enter()
    assert waiting is not None
    waiting.on_abort(lambda: told.append("waiting"))
    assert await a.drain(0.1) is False and told == ["stuck"]
    waiting.release()

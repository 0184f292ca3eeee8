"""Admission's count under races: every way a held request can end, two at a time, in either order, in the same
loop tick or a few apart, with a cancellation (a client leaving) among them.

A request's place in flight is taken once and given back once: after each race the count is back to 0, a
drain-mode release proceeds, and no drain ever finished while a request it should have waited for was still
counted (a bystander request, admitted before the race, shows a count given back twice: the drain would end
while the bystander still runs). The races are driven by loop steps (``asyncio.sleep(0)``), never by time.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from handoff.service.errors import Unavailable
from node_sidecar.admission import Admission, HoldLimits, InFlight, _expire

pytestmark = pytest.mark.timeout(30)

ACTIONS = ("open", "cancel", "expire", "refuse", "release")  # how a held request's wait can end
SETTLE_STEPS = 6  # loop steps for a woken request to reach "the engine" (it needs one)


class Race:
    """One admission with a bystander in flight and one request held; ``do`` runs one action of the race."""

    def __init__(self) -> None:
        self.limits: HoldLimits | None = HoldLimits(4, 60.0, 1 << 20)
        self.admission = Admission(refuse=lambda: Unavailable("closed", type="node_released", retry_after=1),
                                   hold_limits=lambda: self.limits)
        self.admission.open()
        bystander = self.admission.try_enter()
        assert bystander is not None
        self.bystander: InFlight = bystander
        self.admission.close()
        self.engine_done = asyncio.Event()  # the engine ends the racing request
        self.in_engine = False
        self.drains: list[asyncio.Task[bool]] = []
        self.entries: list[Any] = []  # the held request's queue entry, once held
        self.counted_at_release: list[int] = []  # what a drain starting at each release saw
        self.missed_by_a_drain = False  # the request ran after a release whose drain did not count it
        self.task = asyncio.create_task(self._request())

    async def _request(self) -> None:
        """A generation as proxy.py runs it: admitted (maybe after a hold), then the engine, the lease given back
        on the way out whatever happens."""
        lease = await self.admission.enter(num_bytes=10)
        self.missed_by_a_drain = any(n < 2 for n in self.counted_at_release)
        try:
            self.in_engine = True
            await self.engine_done.wait()
        finally:
            self.in_engine = False
            lease.release()

    async def held(self) -> None:
        for _ in range(SETTLE_STEPS):
            if self.admission.num_held == 1:
                self.entries = list(self.admission._held)  # its hold timer's target, kept past the queue
                return
            await asyncio.sleep(0)
        raise AssertionError("the request was never held")

    def do(self, action: str, *, abort: bool = False) -> None:
        a = self.admission
        if action == "open":  # resume: the held requests are admitted
            a.open()
        elif action == "cancel":  # the client leaves (DisconnectWatch cancels the serving task)
            self.task.cancel()
        elif action == "expire":  # the hold timer fires (it may still fire after the request left the queue)
            for held in self.entries:
                _expire(held.future)
        elif action == "refuse":  # the engine went away
            a.refuse_held()
        elif action == "release":  # a release: admission closed, nothing may wait, a drain
            a.close()
            self.limits = None
            a.reapply_limits()
            self.counted_at_release.append(a.num_in_flight)  # a drain's first look, in the release's own step
            self.drains.append(asyncio.create_task(a.drain(10, abort=self._abort if abort else None)))

    async def _abort(self) -> None:
        self.engine_done.set()  # the engine ends every request it runs

    async def settle(self) -> None:
        for _ in range(SETTLE_STEPS):
            await asyncio.sleep(0)

    async def end(self, how: str) -> None:
        """The racing request leaves (ends in the engine, or its client leaves mid-run), then the bystander; no
        drain may end before the bystander left; afterwards nothing is counted and a drain proceeds."""
        a = self.admission
        assert a.num_held == 0 and a.held_bytes == 0
        assert a.num_in_flight == 1 + self.in_engine
        assert not any(d.done() for d in self.drains), "a drain ended while requests were counted"
        if how == "cancel":
            self.task.cancel()
        self.engine_done.set()
        await asyncio.wait({self.task}, timeout=5)
        assert self.task.done() and not self.in_engine
        assert not self.missed_by_a_drain, "a request admitted before a release ran uncounted by its drain"
        if not self.task.cancelled() and self.task.exception() is not None:
            assert isinstance(self.task.exception(), Unavailable)
        await self.settle()
        assert a.num_in_flight == 1, "the racing request's count leaked or was given back twice"
        assert not any(d.done() for d in self.drains), "a drain ended while the bystander was counted"
        self.bystander.release()
        assert all(await asyncio.wait_for(asyncio.gather(*self.drains), 5))
        assert a.num_in_flight == 0 and a.num_held == 0 and a.held_bytes == 0 and not a._cuts
        a.close()
        assert await a.drain(0.05) is True  # a drain-mode release proceeds at once
        a.open()
        lease = a.try_enter()  # and the count still counts from 0
        assert lease is not None and a.num_in_flight == 1
        lease.release()
        assert a.num_in_flight == 0


@pytest.mark.parametrize("gap", [0, 1, 2, 3])
@pytest.mark.parametrize("first,second", list(itertools.permutations(ACTIONS, 2)))
@pytest.mark.parametrize("how", ["finish", "cancel"])
async def test_two_ends_of_a_hold_in_any_order_leave_the_count_whole(first: str, second: str, gap: int,
                                                                     how: str) -> None:
    race = Race()
    await race.held()
    race.do(first)
    for _ in range(gap):
        await asyncio.sleep(0)
    race.do(second)
    await race.settle()
    await race.end(how)


@pytest.mark.parametrize("gap", [0, 1, 2])
@pytest.mark.parametrize("order", [("open", "release"), ("release", "open"), ("open", "cancel", "release"),
                                   ("open", "release", "cancel")])
async def test_an_aborting_release_racing_a_wake_up_ends_with_nothing_counted(order: tuple[str, ...],
                                                                              gap: int) -> None:
    """An abort-mode release right as held requests are woken: the woken one is counted, aborted (or gone with
    its client), given back once; the drain ends with the bystander, which an abort round cuts."""
    race = Race()
    race.bystander.on_abort(race.bystander.release)  # a stream only its client holds: cut at each round
    await race.held()
    for action in order:
        race.do(action, abort=True)
        for _ in range(gap):
            await asyncio.sleep(0)
    assert all(await asyncio.wait_for(asyncio.gather(*race.drains), 5))
    await asyncio.wait({race.task}, timeout=5)
    assert race.task.done() and not race.in_engine and not race.missed_by_a_drain
    if not race.task.cancelled() and race.task.exception() is not None:  # refused: the release came first
        assert isinstance(race.task.exception(), Unavailable)
    a = race.admission
    assert a.num_in_flight == 0 and a.num_held == 0 and not a._cuts
    assert await a.drain(0.05) is True


@pytest.mark.parametrize("steps", range(SETTLE_STEPS))
async def test_a_cancel_at_any_step_after_an_immediate_admit_gives_the_place_back(steps: int) -> None:
    race = Race()
    race.admission.open()  # open from the start: the request enters at once
    for _ in range(steps):
        await asyncio.sleep(0)
    race.task.cancel()
    await asyncio.wait({race.task}, timeout=5)
    assert race.task.cancelled() and race.admission.num_in_flight == 1
    race.bystander.release()
    assert race.admission.num_in_flight == 0 and await race.admission.drain(0.05) is True

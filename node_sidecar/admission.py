"""Admission of generation requests: count them in flight, close for drains, hold or refuse.

Rules:
- While open, a request enters at once and is counted until its last byte:
  entering gives an :class:`InFlight` lease, and the count drops when the
  lease is released (once, however many times it is called).
- While closed, a request is held in a FIFO queue, at most as many, as many
  bytes of bodies and as long as the :class:`HoldLimits` of the moment say (the
  node knows why it is closed: a pause, a weight update, ``--hold-requests``),
  or refused when there are none; when the reason changes, the held requests
  follow the new limits (:meth:`Admission.reapply_limits`); reopening admits
  them in arrival order.
- ``drain`` waits, with a deadline, until nothing is in flight; it wakes the
  moment the last request leaves (no polling). A drain that aborts sends its
  abort again at growing intervals while requests remain: a request counted
  here but still on its way to the engine when an abort arrived there would
  otherwise run to its end. At each of those rounds the requests that said how
  to be cut (:meth:`InFlight.on_abort`: a stream whose client stopped reading)
  are told: once the engine ended them only their client holds them.

Entering and counting happen in one synchronous step of the event loop, so a
drain never misses a request that was admitted just before admission closed.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Awaitable, Callable

from handoff.service.errors import Unavailable

FIRST_ABORT_INTERVAL_S = 0.05
MAX_ABORT_INTERVAL_S = 0.5


class AdmissionState(str, enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class InFlight:
    """One admitted request's place in the in-flight count, taken when it is made; :meth:`release` gives it back
    (idempotent). The only owner of a count: whoever admits a request makes one, and its holder releases it."""

    __slots__ = ("_admission", "_is_released")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._is_released = False
        admission._count_in()

    def on_abort(self, cut: Callable[[], None]) -> None:
        """``cut`` runs at each round of an aborting drain while this request is counted (until released)."""
        if not self._is_released:
            self._admission._cuts[self] = cut

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._admission._cuts.pop(self, None)
            self._admission._count_out()


@dataclass(frozen=True)
class HoldLimits:
    """How many requests may wait while admission is closed, how many bytes of bodies they may hold, and for how
    long each may wait (from when it arrived)."""

    max_held: int
    timeout_s: float
    max_bytes: int


@dataclass(eq=False)
class _Held:
    """One waiting request: admitted or refused through ``future``; its timer refuses it at its deadline."""

    future: asyncio.Future[InFlight]  # its result: the place :meth:`Admission.open` took for it
    arrived: float
    num_bytes: int
    timer: asyncio.TimerHandle | None = None

    def arm(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_at(self.arrived + timeout_s, _expire, self.future)


class Admission:
    def __init__(self, *, refuse: Callable[[], Unavailable],
                 hold_limits: Callable[[], HoldLimits | None] = lambda: None) -> None:
        """``hold_limits``: whether a request arriving while closed waits, and within which bounds (None:
        refused); asked again by :meth:`reapply_limits` when the reason admission is closed changes. ``refuse``
        builds the 503 for the current reason."""
        self.state = AdmissionState.CLOSED
        self._hold_limits = hold_limits
        self._refuse = refuse
        self.num_in_flight = 0
        # the requests waiting, in arrival order; each leaves the moment it is admitted, refused, expired or
        # given up by its client (a queue pruned only from its head kept every one that left behind a request
        # still waiting: a client sending and dropping requests grew it without bound, and each arrival counted
        # it whole)
        self._held: dict[_Held, None] = {}
        self._held_bytes = 0
        self._cuts: dict[InFlight, Callable[[], None]] = {}  # see InFlight.on_abort
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def is_open(self) -> bool:
        return self.state is AdmissionState.OPEN

    @property
    def is_holding(self) -> bool:
        """Whether a request arriving while closed would be held now (else refused)."""
        return self._hold_limits() is not None

    @property
    def view(self) -> str:
        """``open``; ``holding``: closed, a request arriving now would wait; ``closed``: it would be refused."""
        if self.is_open:
            return "open"
        return "holding" if self.is_holding else "closed"

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def try_enter(self) -> InFlight | None:
        """Enter now if open (counted in flight until the lease is released); never waits."""
        if self.state is not AdmissionState.OPEN:
            return None
        return InFlight(self)

    async def enter(self, *, may_hold: bool = True, num_bytes: int = 0) -> InFlight:
        """Enter, waiting in the hold queue if allowed (``num_bytes``: what the request's body holds while it
        waits); raises the 503 otherwise."""
        lease = self.try_enter()
        if lease is not None:
            return lease
        limits = self._hold_limits() if may_hold else None
        if limits is None or self.num_held >= limits.max_held or self.held_bytes + num_bytes > limits.max_bytes:
            raise self._refuse()
        loop = asyncio.get_running_loop()
        held = _Held(loop.create_future(), loop.time(), num_bytes)
        held.arm(loop, limits.timeout_s)
        self._held[held] = None
        self._held_bytes += num_bytes
        held.future.add_done_callback(lambda _: self._forget(held))  # refused or expired: out of the counts
        # Awaited bare (no wait_for): a client leaving in the same loop tick as it is admitted or refused is
        # still seen leaving (wait_for before Python 3.12 swallows that cancellation).
        try:
            return await held.future
        except _HoldExpired:
            raise self._refuse() from None
        except asyncio.CancelledError:
            if _was_admitted(held.future):
                held.future.result().release()  # admitted, but the client went away before running
            raise
        finally:
            if held.timer is not None:
                held.timer.cancel()
            self._forget(held)

    def reapply_limits(self) -> None:
        """The reason admission is closed changed (a pause ended on a released node, say): the held requests
        follow the limits of now. Each keeps its arrival time; past the new count or bytes, the newest are
        refused; with no limits at all, every one is."""
        limits = self._hold_limits()
        if limits is None:
            self.refuse_held()
            return
        loop = asyncio.get_running_loop()
        num_kept = num_bytes = 0
        for held in list(self._held):
            if held.future.done():
                continue
            if num_kept + 1 > limits.max_held or num_bytes + held.num_bytes > limits.max_bytes:
                held.future.set_exception(self._refuse())
                continue
            num_kept += 1
            num_bytes += held.num_bytes
            held.arm(loop, limits.timeout_s)

    def close(self) -> None:
        self.state = AdmissionState.CLOSED

    def open(self) -> None:
        """Open and admit the held requests, oldest first."""
        self.state = AdmissionState.OPEN
        for held in self._take_all():
            if not held.future.done():
                held.future.set_result(InFlight(self))

    def refuse_held(self) -> None:
        """Refuse every held request now (the node cannot serve for a while)."""
        for held in self._take_all():
            if not held.future.done():
                held.future.set_exception(self._refuse())

    async def drain(self, timeout: float, *, abort: Callable[[], Awaitable[object]] | None = None) -> bool:
        """Wait until nothing is in flight; False if ``timeout`` passed first. ``abort`` (ending every request
        in the engine) runs at once and again, at growing intervals, while requests remain; an abort not done by
        the deadline (a hung engine) is given up, and the drain has failed."""
        if self.num_in_flight == 0:
            return True
        if abort is None:
            return await self._wait_idle(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        interval = FIRST_ABORT_INTERVAL_S
        while True:
            try:
                await asyncio.wait_for(abort(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return False
            remaining = deadline - loop.time()
            if await self._wait_idle(max(0.0, min(interval, remaining))):
                return True
            for cut in list(self._cuts.values()):
                cut()
            if remaining <= interval:
                return False
            interval = min(2 * interval, MAX_ABORT_INTERVAL_S)

    async def _wait_idle(self, timeout: float) -> bool:
        if self.num_in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _count_in(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def _count_out(self) -> None:
        if self.num_in_flight <= 0:
            raise RuntimeError("admission: a request left that never entered")
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    def _forget(self, held: _Held) -> None:
        """``held`` has left the queue (idempotent)."""
        if held in self._held:
            del self._held[held]
            self._held_bytes -= held.num_bytes

    def _take_all(self) -> list[_Held]:
        """Every held request, oldest first, out of the queue."""
        taken = list(self._held)
        self._held.clear()
        self._held_bytes = 0
        return taken


class _HoldExpired(Exception):
    """A held request's hold timeout passed before admission opened."""


def _expire(waiter: asyncio.Future[InFlight]) -> None:
    if not waiter.done():
        waiter.set_exception(_HoldExpired())


def _was_admitted(waiter: asyncio.Future[InFlight]) -> bool:
    """Counted in by :meth:`Admission.open` (not refused, expired or cancelled); retrieves any exception."""
    return waiter.done() and not waiter.cancelled() and waiter.exception() is None

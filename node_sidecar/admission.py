"""Admission of generation requests: count them in flight, close for drains, hold or refuse.

Rules:
- While open, a request enters at once and is counted until its last byte:
  entering gives an :class:`InFlight` lease, and the count drops when the
  lease is released (once, however many times it is called).
- While closed, a request is held in a FIFO queue (with ``--hold-requests``,
  at most ``hold_max`` of them, each at most ``hold_timeout`` seconds) or
  refused; reopening admits the held requests in arrival order.
- ``drain`` waits, with a deadline, until nothing is in flight; it wakes the
  moment the last request leaves (no polling).

Entering and counting happen in one synchronous step of the event loop, so a
drain never misses a request that was admitted just before admission closed.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import Callable

from handoff.service.errors import Unavailable


class AdmissionState(str, enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class InFlight:
    """One admitted request's place in the in-flight count; :meth:`release` gives it back (idempotent)."""

    __slots__ = ("_admission", "_is_released")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._admission._count_out()


class Admission:
    def __init__(self, *, hold_max: int | None, hold_timeout: float, refuse: Callable[[], Unavailable],
                 hold_while: Callable[[], bool] | None = None) -> None:
        """``hold_max`` None: refuse while closed. ``hold_while``: hold only while it says so (None: always).
        ``refuse`` builds the 503 for the current reason."""
        self.state = AdmissionState.CLOSED
        self.hold_max = hold_max
        self._hold_while = hold_while
        self.hold_timeout = hold_timeout
        self._refuse = refuse
        self.num_in_flight = 0
        self._held: deque[asyncio.Future[None]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def is_open(self) -> bool:
        return self.state is AdmissionState.OPEN

    @property
    def is_holding(self) -> bool:
        """Whether a request arriving while closed would be held now (else refused)."""
        return self.hold_max is not None and (self._hold_while is None or self._hold_while())

    @property
    def num_held(self) -> int:
        return sum(1 for f in self._held if not f.done())

    def try_enter(self) -> InFlight | None:
        """Enter now if open (counted in flight until the lease is released); never waits."""
        if self.state is not AdmissionState.OPEN:
            return None
        self._count_in()
        return InFlight(self)

    async def enter(self, *, may_hold: bool = True) -> InFlight:
        """Enter, waiting in the hold queue if allowed; raises the 503 otherwise."""
        lease = self.try_enter()
        if lease is not None:
            return lease
        if not may_hold or not self.is_holding:
            raise self._refuse()
        if self.num_held >= self.hold_max:
            raise self._refuse()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._held.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.hold_timeout)
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return InFlight(self)  # admitted at the very deadline: it was counted, so it runs
            waiter.cancel()
            raise self._refuse() from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._count_out()  # admitted, but the client went away before running
            else:
                waiter.cancel()
            raise
        finally:
            self._prune()
        return InFlight(self)

    def close(self) -> None:
        self.state = AdmissionState.CLOSED

    def open(self) -> None:
        """Open and admit the held requests, oldest first."""
        self.state = AdmissionState.OPEN
        while self._held:
            waiter = self._held.popleft()
            if not waiter.done():
                self._count_in()
                waiter.set_result(None)

    def refuse_held(self) -> None:
        """Refuse every held request now (the node cannot serve for a while)."""
        while self._held:
            waiter = self._held.popleft()
            if not waiter.done():
                waiter.set_exception(self._refuse())

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False if ``timeout`` passed first."""
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

    def _prune(self) -> None:
        while self._held and self._held[0].done():
            self._held.popleft()

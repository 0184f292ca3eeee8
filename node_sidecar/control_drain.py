"""The drain before a control call's work (admission held closed for it by :meth:`Node.draining`): the node
emptied of generation (:meth:`Drainer.drain`: waited for or aborted, counted, bounded by a :class:`DrainLimit`),
then the engine itself idle (a request whose client left is out of the sidecar's count at once, but runs in the
engine until the engine sees its connection closed; an engine that refuses a release while one runs answered a
drained node's release 409 ``requests_in_flight``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from node_sidecar.errors import DrainTimeout
from node_sidecar.node import Node

FIRST_IDLE_POLL_S = 0.01
MAX_IDLE_POLL_S = 0.2
MIN_ASK_S = 0.2  # an engine's answer is waited for this long even when the drain's time is spent (an idle
# engine still answers 0 in time; the caller's deadline header keeps a margin of at least this much)


@dataclass(frozen=True)
class DrainLimit:
    """How long a drain may wait: the asked (or default) seconds, cut short so that the caller, who stops waiting
    at ``answer_by`` (event-loop time, its margin taken), still gets the answer (409 ``drain_timeout``)."""

    seconds: float
    answer_by: float | None = None

    def remaining(self) -> float:
        if self.answer_by is None:
            return self.seconds
        return max(0.0, min(self.seconds, self.answer_by - asyncio.get_running_loop().time()))


class Drainer:
    """The node's drains, for :class:`~node_sidecar.control.ControlPlane` (under its control lock)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.metrics = node.metrics

    async def drain(self, mode: str, limit: DrainLimit) -> tuple[int, int]:
        """Empty the node of generation; returns (drained, aborted). Raises DrainTimeout."""
        timeout = limit.remaining()
        deadline = asyncio.get_running_loop().time() + timeout
        admission = self.node.admission
        num_in_flight = admission.num_in_flight
        adapter = self.node.engine_adapter
        abort = (lambda: adapter.abort(rid=None, abort_all=True)) if mode == "abort" else None
        if not await admission.drain(timeout, abort=abort):
            raise DrainTimeout(f"{admission.num_in_flight} generation request(s) still running after "
                               f"{timeout:g}s; nothing was released", extra={"in_flight": admission.num_in_flight})
        await self._engine_idle(deadline, timeout)
        if mode == "abort":
            self.metrics.aborted_requests.inc(num_in_flight)
            return 0, num_in_flight
        self.metrics.drained_requests.inc(num_in_flight)
        return num_in_flight, 0

    async def _engine_idle(self, deadline: float, timeout: float) -> None:
        """Poll, with ``deadline``, until the engine runs no generation (an engine that does not say: at once);
        DrainTimeout past it, nothing done."""
        loop = asyncio.get_running_loop()
        delay = FIRST_IDLE_POLL_S
        while num := await self._requests_running(deadline, timeout):
            if loop.time() + delay > deadline:
                raise DrainTimeout(f"the engine still runs {num} generation request(s) after {timeout:g}s (ones "
                                   "whose clients left end there once it sees their connections closed); nothing "
                                   "was released", extra={"in_flight": num})
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_IDLE_POLL_S)

    async def _requests_running(self, deadline: float, timeout: float) -> int | None:
        """The engine's running requests, asked within what is left of the drain (an engine slow to say would
        otherwise keep the answer past the caller's deadline); DrainTimeout past it."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(max(deadline, loop.time() + MIN_ASK_S)):
                return await self.node.engine_adapter.requests_running()
        except TimeoutError:
            raise DrainTimeout(f"the engine did not say within {timeout:g}s whether it still runs generation "
                               "requests; nothing was released") from None

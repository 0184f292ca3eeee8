"""The drain before a control call's work (admission held closed for it by :meth:`Node.draining`): the node
emptied of generation (:meth:`Drainer.drain`: waited for or aborted, counted, bounded by a :class:`DrainLimit`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from node_sidecar.errors import DrainTimeout
from node_sidecar.node import Node


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
        admission = self.node.admission
        num_in_flight = admission.num_in_flight
        adapter = self.node.engine_adapter
        abort = (lambda: adapter.abort(rid=None, abort_all=True)) if mode == "abort" else None
        if not await admission.drain(timeout, abort=abort):
            raise DrainTimeout(f"{admission.num_in_flight} generation request(s) still running after "
                               f"{timeout:g}s; nothing was released", extra={"in_flight": admission.num_in_flight})
        if mode == "abort":
            self.metrics.aborted_requests.inc(num_in_flight)
            return 0, num_in_flight
        self.metrics.drained_requests.inc(num_in_flight)
        return num_in_flight, 0

"""The bytes the sidecar holds for generation in flight, bounded (``--max-inflight-bytes``).

An admitted request's body stays in memory until its last byte went out, and
a non-stream answer is buffered whole (up to ``--max-answer-bytes`` each): a
burst of large requests would otherwise grow the sidecar past its container's
memory limit, and the OOM killer would end every request it ran. Each admitted
request takes a :class:`BytesLease`, given back with its place in flight:

- its body is taken before anything is sent to the engine; past the bound
  the request is 503 ``overloaded`` with ``Retry-After`` (nothing ran, so a
  router may send it elsewhere);
- a non-stream answer is taken as its bytes arrive; one that would pass the
  bound is dropped (the engine connection closed), a 502 naming the flag, as
  one over ``--max-answer-bytes`` is.
"""

from __future__ import annotations

from handoff.protocol import errors as E
from handoff.service.errors import ServiceError, Unavailable
from handoff.service.limits import OVERLOADED_RETRY_AFTER_S

FLAG = "--max-inflight-bytes"


class InFlightBytes:
    """The bytes of bodies and buffered answers that every admitted generation request holds, and their bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def lease(self) -> BytesLease:
        """An empty lease for one request (its bytes are given back by :meth:`BytesLease.release`)."""
        return BytesLease(self)


class BytesLease:
    """One request's bytes in the budget; :meth:`release` gives them all back (idempotent)."""

    __slots__ = ("_budget", "num_bytes", "_is_released")

    def __init__(self, budget: InFlightBytes) -> None:
        self._budget = budget
        self.num_bytes = 0
        self._is_released = False

    def take_body(self, num_bytes: int) -> None:
        """Count the request's body, or raise the 503 ``overloaded`` (nothing counted)."""
        if not self._take(num_bytes):
            budget = self._budget
            raise Unavailable(f"this node holds {budget.in_use} bytes of generation bodies and answers in flight; "
                              f"{num_bytes} more would pass its limit of {budget.limit} ({FLAG}); try again shortly",
                              type=E.OVERLOADED.name, retry_after=OVERLOADED_RETRY_AFTER_S,
                              extra={"max_bytes": budget.limit})

    def take_answer(self, num_bytes: int) -> None:
        """Count ``num_bytes`` more of a buffered answer, or raise the 502 (nothing counted)."""
        if not self._take(num_bytes):
            budget = self._budget
            raise ServiceError(f"the engine's answer was dropped at {self.num_bytes} bytes: the generation bodies "
                               f"and answers in flight would pass this node's limit of {budget.limit} bytes ({FLAG})",
                               kind=E.UPSTREAM_ERROR, extra={"max_bytes": budget.limit})

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._budget.in_use -= self.num_bytes

    def _take(self, num_bytes: int) -> bool:
        budget = self._budget
        if self._is_released or budget.in_use + num_bytes > budget.limit:
            return False
        budget.in_use += num_bytes
        self.num_bytes += num_bytes
        return True

"""The bytes of the non-stream answers the LB holds at once, bounded (``--max-buffered-answer-bytes``).

A node's non-stream generation answer is read whole before it is relayed (so a
failure midway is a status), up to ``--max-answer-bytes`` each, and stays in
memory until its last byte went out to the client: without a bound on them all,
a handful of large answers at once (or a few slow clients) would grow the LB,
the cluster's only URL, past its container's memory, and the OOM killer would
end every request and stream it carries. The sidecar bounds the same bytes
with ``--max-inflight-bytes``.

Each generation request gets a :class:`~handoff.service.limits.BudgetShare` of
the process's answer budget for as long as it is served, its answer sent
included (:func:`answer_share`, entered by the generation endpoint around the
whole exchange); :meth:`lb.relay.NodeCaller.read_body` counts each piece of an
answer into it as it arrives (:func:`count_answer`). An answer that would pass
the bound is dropped, its node's connection closed, and the client gets 503
``overloaded`` with ``Retry-After``, as a sidecar's full budget answers: the
node did nothing wrong, and the same request may pass a moment later. Streams
are relayed as they come and hold no answer.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

from handoff.protocol import errors as E
from handoff.service.errors import Unavailable
from handoff.service.limits import OVERLOADED_RETRY_AFTER_S, BodyBudget, BudgetShare

FLAG = "--max-buffered-answer-bytes"
DEFAULT_MAX_BUFFERED_ANSWER_BYTES = 1024 * 1024 * 1024  # four answers of the largest size (--max-answer-bytes)

# the share of the request the current task serves (tasks it starts inherit it); None outside a generation request
_SHARE: ContextVar[BudgetShare | None] = ContextVar("lb_answer_share", default=None)


def _overloaded(budget: BodyBudget, num_bytes: int) -> Unavailable:
    return Unavailable(f"the LB holds {budget.in_use} bytes of non-stream answers; {num_bytes} more would pass its "
                       f"limit of {budget.limit} ({FLAG}); try again shortly, or stream the answer "
                       "(\"stream\": true)", type=E.OVERLOADED.name, retry_after=OVERLOADED_RETRY_AFTER_S,
                       extra={"max_bytes": budget.limit})


class answer_share(BudgetShare):
    """A share of ``budget`` for one request, current in this task (and those it starts) for its ``with`` block:
    every byte counted into it is given back when the block ends, however it ends. (A class, not a generator
    context manager: it is entered by every generation request.)"""

    def __init__(self, budget: BodyBudget) -> None:
        super().__init__(budget, _overloaded)
        self._token: Token[BudgetShare | None] | None = None

    def __enter__(self) -> BudgetShare:
        super().__enter__()
        self._token = _SHARE.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _SHARE.reset(self._token)
            self._token = None
        super().__exit__(*exc_info)


def count_answer(num_bytes: int) -> None:
    """Count ``num_bytes`` more of a buffered answer into the current request's share; raises the 503
    ``overloaded`` past the budget (nothing counted). Outside a generation request (none current) nothing is
    counted."""
    share = _SHARE.get()
    if share is not None:
        share.take(num_bytes)

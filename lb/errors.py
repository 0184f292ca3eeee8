"""The LB's own errors; each becomes the JSON envelope with its status (SPEC section 6)."""

from __future__ import annotations

from handoff.protocol import errors as E
from handoff.service.errors import Conflict, NotFound, ServiceError, Unavailable


class NoNodes(Unavailable):
    """A control fan-out has no node to go to. A 503 like every not-serving one, so with ``Retry-After``: members
    may come from DNS discovery or the admin API at any moment."""

    kind = E.NO_NODES

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)


class NoAvailableNode(Unavailable):
    """No node can take a generation request now (released, draining, unhealthy, refused)."""

    kind = E.NO_AVAILABLE_NODE


class UpstreamFailed(ServiceError):
    """The node chosen for a generation request failed after it may have started the work."""

    kind = E.UPSTREAM_ERROR


class UpstreamTimedOut(ServiceError):
    kind = E.UPSTREAM_TIMEOUT


class NodeExists(Conflict):
    kind = E.NODE_EXISTS


class TooManyNodes(Conflict):
    """The LB already holds ``--max-nodes`` members."""

    kind = E.TOO_MANY_NODES


class NodeNotFound(NotFound):
    kind = E.NODE_NOT_FOUND


class WeightGroupLost(Conflict):
    """A node of the weight group an update names lost the group with a restart of its engine."""

    kind = E.WEIGHT_SYNC_BROKEN

"""The LB's own errors; each becomes the JSON envelope with its status (SPEC section 6)."""

from __future__ import annotations

from handoff.service.errors import Conflict, NotFound, ServiceError, Unavailable


class NoNodes(Unavailable):
    """A control fan-out has no node to go to."""

    type = "no_nodes"


class NoAvailableNode(Unavailable):
    """No node can take a generation request now (released, draining, unhealthy, refused)."""

    type = "no_available_node"


class UpstreamFailed(ServiceError):
    """The node chosen for a generation request failed after it may have started the work."""

    status = 502
    type = "upstream_error"


class UpstreamTimedOut(ServiceError):
    status = 504
    type = "upstream_timeout"


class NodeExists(Conflict):
    type = "node_exists"


class NodeNotFound(NotFound):
    type = "node_not_found"

"""One member of the LB: its lifecycle, what it last reported, and the scoped objects that count work on it.

Health is a lifecycle with guarded transitions; whether a node may take
generation (:attr:`Node.is_routable`) is derived from health, the last
``/memory_occupation`` answer and control fan-outs in progress. A request in
flight holds a :class:`RequestLease`, a release or pause a :class:`Fence`:
each gives its place back once, whoever holds it last.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable

from prometheus_client import Gauge

from lb.addresses import literal_addresses, split_canonical
from lb.config import NodeSpec
from lb.metrics import LBMetrics

log = logging.getLogger(__name__)


class InflightCount:
    """Generation requests this LB has in flight to one URL.

    It belongs to the URL, not to a :class:`Node`: a node that leaves (a DNS
    round that missed it) and comes back while its requests still run is
    counted with them, and their leases, held by the old node, count down the
    same number. ``on_idle`` runs when it reaches 0 (the membership forgets
    the count of a URL that is no longer a member)."""

    __slots__ = ("value", "on_idle", "_gauge")

    def __init__(self) -> None:
        self.value = 0
        self.on_idle: Callable[[], None] | None = None
        self._gauge: Gauge | None = None

    def publish_to(self, gauge: Gauge) -> None:
        """Show the count on ``gauge`` (the current member's labelled gauge) from now on."""
        self._gauge = gauge
        gauge.set(self.value)

    def add(self, delta: int) -> None:
        self.value += delta
        if self._gauge is not None:
            self._gauge.inc(delta)
        if self.value == 0 and self.on_idle is not None:
            self.on_idle()


class NodeHealth(enum.Enum):
    UNKNOWN = "unknown"      # not checked yet; not routable
    HEALTHY = "healthy"      # answers its health checks
    UNHEALTHY = "unhealthy"  # failed ``unhealthy_threshold`` checks in a row, or refused a connection
    REMOVED = "removed"      # left the membership; final


_HEALTH_MOVES = {
    NodeHealth.UNKNOWN: {NodeHealth.HEALTHY, NodeHealth.UNHEALTHY, NodeHealth.REMOVED},
    NodeHealth.HEALTHY: {NodeHealth.UNHEALTHY, NodeHealth.REMOVED},
    NodeHealth.UNHEALTHY: {NodeHealth.HEALTHY, NodeHealth.REMOVED},
    NodeHealth.REMOVED: set(),
}


class Node:
    """One member. Mutated only on the event loop, so no locks."""

    def __init__(self, spec: NodeSpec, source: str, metrics: LBMetrics, inflight: InflightCount,
                 addresses: frozenset[str] = frozenset()) -> None:
        self.url = spec.url
        self.registered_url = spec.url  # the spelling the worker API lists (sglang-router lists a URL as given)
        self.host, self.port = split_canonical(spec.url)
        self.literal_addresses = literal_addresses(self.host) or frozenset()  # empty: a host name
        self.addresses = addresses  # what the host stood for when the node joined (may be empty: not resolved)
        self.role = spec.role
        self.bootstrap_port = spec.bootstrap_port
        self.source = source
        self.health = NodeHealth.UNKNOWN
        self.is_sidecar: bool | None = None  # None until /memory_occupation answered or 404ed
        self.is_serving = False
        self.admission: str | None = None
        self.occupation: dict[str, Any] = {}
        self.num_fences = 0  # release/pause fan-outs in progress that target this node
        self.num_states_applied = 0  # states taken from control answers and 503s (a check under way meanwhile is stale)
        self.num_failures_in_row = 0
        self.num_successes_in_row = 0
        self.last_error: str | None = None
        self.last_seen: float | None = None
        labels = {"node": self.url, "role": self.role.value}
        self._inflight = inflight
        inflight.publish_to(metrics.node_inflight.labels(**labels))
        self._healthy_gauge = metrics.node_healthy.labels(**labels)
        self._serving_gauge = metrics.node_serving.labels(**labels)
        self._published = (False, False)  # (healthy, routable) as the gauges show them; a new one shows 0

    def register_as(self, url: str) -> None:
        """The URL the worker API lists this node under from now on: as its last registration spelled it."""
        self.registered_url = url.strip()

    @property
    def num_inflight(self) -> int:
        """Generation requests this LB has running on the node's URL (those sent before it left and joined
        again included)."""
        return self._inflight.value

    @property
    def is_removed(self) -> bool:
        return self.health is NodeHealth.REMOVED

    @property
    def is_routable(self) -> bool:
        """May take generation now: healthy, serving and not being released or paused."""
        return self.health is NodeHealth.HEALTHY and self.is_serving and self.num_fences == 0

    @property
    def is_holding(self) -> bool:
        """Not serving but queues requests until it serves again (a sidecar with ``--hold-requests``)."""
        return (self.health is NodeHealth.HEALTHY and not self.is_serving and self.admission == "holding"
                and self.num_fences == 0)

    def set_health(self, new: NodeHealth) -> None:
        if new is self.health:
            return
        if new not in _HEALTH_MOVES[self.health]:
            raise RuntimeError(f"node {self.url} is {self.health.value}, cannot become {new.value}")
        log.info("node %s (%s): %s -> %s", self.url, self.role.value, self.health.value, new.value)
        self.health = new
        self._update_gauges()

    def set_serving(self, is_serving: bool, admission: str | None) -> None:
        if is_serving is not self.is_serving:
            self.is_serving = is_serving
            self._update_gauges()
        self.admission = admission

    def record_error(self, message: str) -> None:
        self.last_error = message

    # -- what health checks (lb.health) count ---------------------------------
    def count_failure(self, error: str) -> int:
        """A failed health check; returns how many failed in a row."""
        self.num_successes_in_row = 0
        self.num_failures_in_row += 1
        self.record_error(error)
        return self.num_failures_in_row

    def count_success(self, state: dict[str, Any]) -> int:
        """A good health check, or a control answer carrying the node's ``state`` (taken as what it last
        reported); returns how many succeeded in a row."""
        self.num_failures_in_row = 0
        self.num_successes_in_row += 1
        self.mark_seen()
        if "tags" in state:
            self.is_sidecar = True
        self.occupation = state
        return self.num_successes_in_row

    def count_refusal(self, error: str) -> None:
        """A connection refused on the request path: it ends a run of good checks."""
        self.num_successes_in_row = 0
        self.record_error(error)

    def mark_plain(self) -> None:
        """No ``/memory_occupation`` here (404 or 405): a plain server, checked with ``/health`` from now on."""
        self.is_sidecar = False

    def count_state_applied(self) -> None:
        """A control answer's state, a generation's 503 saying the node does not serve, or a refused connection is
        taken: a check under way meanwhile read an older state."""
        self.num_states_applied += 1

    def begin_request(self) -> RequestLease:
        """Count a generation request in flight here until the returned lease is released."""
        self._inflight.add(1)
        return RequestLease(self)

    def _end_request(self) -> None:
        self._inflight.add(-1)

    def fence(self) -> Fence:
        """Stop routing here while a release or pause is under way, until the returned fence is lifted."""
        self.num_fences += 1
        if self.num_fences == 1:  # only the first fence and the last lift can change what the gauges show
            self._update_gauges()
        return Fence(self)

    def _lift_fence(self) -> None:
        self.num_fences -= 1
        if self.num_fences == 0:
            self._update_gauges()

    def _update_gauges(self) -> None:
        """Publish what changed (a fan-out touches every node's state; most of the time nothing changes)."""
        health = self.health
        if health is NodeHealth.REMOVED:
            return
        healthy = health is NodeHealth.HEALTHY
        published = (healthy, healthy and self.is_serving and self.num_fences == 0)  # is_routable, inlined
        if published != self._published:
            if published[0] != self._published[0]:
                self._healthy_gauge.set(int(published[0]))
            if published[1] != self._published[1]:
                self._serving_gauge.set(int(published[1]))
            self._published = published

    def mark_seen(self) -> None:
        self.last_seen = time.time()


class RequestLease:
    """A generation request's place in a node's in-flight count, given back once by whoever holds it last.

    Use it as a context manager around the work that sends the request; a
    response that goes on relaying after the handler returned takes it with
    :meth:`hand_over`, and the block's exit then leaves it alone.
    """

    __slots__ = ("node", "_is_released")

    def __init__(self, node: Node) -> None:
        self.node = node
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self.node._end_request()

    def hand_over(self) -> RequestLease:
        """The same place, owned by a new lease; this one no longer releases it."""
        if self._is_released:
            raise RuntimeError(f"request lease on {self.node.url} was already released")
        self._is_released = True
        return RequestLease._owning(self.node)

    @classmethod
    def _owning(cls, node: Node) -> RequestLease:
        lease = cls.__new__(cls)
        lease.node, lease._is_released = node, False
        return lease

    def __enter__(self) -> RequestLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class Fence:
    """One reason not to route generation to a node; :meth:`lift` (once, idempotent) removes it.

    A fence travels with the work that needs it (a fan-out call, then perhaps a
    check of the node in the background) and is lifted when that work ends. Use
    it as a context manager around that work; work that goes on after the block
    (a check in the background) takes it with :meth:`hand_over`, and the
    block's exit then leaves it alone.
    """

    __slots__ = ("_node", "_is_lifted")

    def __init__(self, node: Node) -> None:
        self._node = node
        self._is_lifted = False

    def lift(self) -> None:
        if not self._is_lifted:
            self._is_lifted = True
            self._node._lift_fence()

    def hand_over(self) -> Fence:
        """The same fence, owned by a new object; this one no longer lifts it (already lifted: RuntimeError)."""
        if self._is_lifted:
            raise RuntimeError(f"fence on {self._node.url} was already lifted")
        self._is_lifted = True
        return Fence(self._node)

    def __enter__(self) -> Fence:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.lift()

"""Which nodes the LB knows, and what it last learned about each one.

A :class:`Node` is created when a flag, DNS discovery or ``POST /nodes`` adds
it and is ``REMOVED`` for good when it leaves; requests already running on it
finish. Health is a lifecycle with guarded transitions; whether a node may
take generation (:attr:`Node.is_routable`) is derived from health, the last
``/memory_occupation`` answer and control fan-outs in progress.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Iterable

from lb.addresses import literal_addresses, split_canonical
from lb.config import NodeSpec, Role
from lb.errors import NodeExists, NodeNotFound
from lb.metrics import LBMetrics

log = logging.getLogger(__name__)


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

    def __init__(self, spec: NodeSpec, source: str, metrics: LBMetrics,
                 addresses: frozenset[str] = frozenset()) -> None:
        self.url = spec.url
        self.host, self.port = split_canonical(spec.url)
        self.addresses = addresses  # what the host stood for when the node joined (may be empty: not resolved)
        self.role = spec.role
        self.bootstrap_port = spec.bootstrap_port
        self.source = source
        self.health = NodeHealth.UNKNOWN
        self.is_sidecar: bool | None = None  # None until /memory_occupation answered or 404ed
        self.is_serving = False
        self.admission: str | None = None
        self.occupation: dict[str, Any] = {}
        self.num_inflight = 0
        self.num_fences = 0  # release/pause fan-outs in progress that target this node
        self.num_failures_in_row = 0
        self.num_successes_in_row = 0
        self.last_error: str | None = None
        self.last_seen: float | None = None
        labels = {"node": self.url, "role": self.role.value}
        self._inflight_gauge = metrics.node_inflight.labels(**labels)
        self._healthy_gauge = metrics.node_healthy.labels(**labels)
        self._serving_gauge = metrics.node_serving.labels(**labels)
        self._published = (0, 0)  # (healthy, routable) as the gauges show them; a new labelled gauge shows 0

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
        self.is_serving = is_serving
        self.admission = admission
        self._update_gauges()

    def record_error(self, message: str) -> None:
        self.last_error = message

    def begin_request(self) -> RequestLease:
        """Count a generation request in flight here until the returned lease is released."""
        self.num_inflight += 1
        self._inflight_gauge.inc()
        return RequestLease(self)

    def _end_request(self) -> None:
        self.num_inflight -= 1
        self._inflight_gauge.dec()

    def fence(self) -> Fence:
        """Stop routing here while a release or pause is under way, until the returned fence is lifted."""
        self.num_fences += 1
        self._update_gauges()
        return Fence(self)

    def _lift_fence(self) -> None:
        self.num_fences -= 1
        self._update_gauges()

    def _update_gauges(self) -> None:
        """Publish what changed (a fan-out touches every node's state three times; most leave it as it was)."""
        if self.is_removed:
            return
        healthy, routable = int(self.health is NodeHealth.HEALTHY), int(self.is_routable)
        if healthy != self._published[0]:
            self._healthy_gauge.set(healthy)
        if routable != self._published[1]:
            self._serving_gauge.set(routable)
        self._published = (healthy, routable)

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
    check of the node in the background) and is lifted when that work ends.
    """

    __slots__ = ("_node", "_is_lifted")

    def __init__(self, node: Node) -> None:
        self._node = node
        self._is_lifted = False

    def lift(self) -> None:
        if not self._is_lifted:
            self._is_lifted = True
            self._node._lift_fence()

    def __enter__(self) -> Fence:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.lift()


class Membership:
    """The nodes by URL, in the order they joined, with per-role lists kept for routing."""

    def __init__(self, metrics: LBMetrics) -> None:
        self._metrics = metrics
        self._nodes: dict[str, Node] = {}
        self._by_role: dict[Role, list[Node]] = {role: [] for role in Role}
        for role in Role:
            metrics.nodes.labels(role=role.value).set(0)

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self, role: Role | None = None) -> list[Node]:
        """Members (of ``role``), in joining order. A role's list is shared: do not mutate it."""
        return list(self._nodes.values()) if role is None else self._by_role[role]

    def get(self, url: str) -> Node | None:
        return self._nodes.get(url)

    def same_address(self, url: str, addresses: frozenset[str] = frozenset(), *, learned: bool = True
                     ) -> Node | None:
        """The member at ``url`` (canonical, as :class:`NodeSpec` spells it) or at one of ``addresses`` on its
        port: the same node spelled another way. Spellings known without a lookup always count (an IP literal,
        ``localhost``); ``learned``: so do the addresses members' names resolved to (kept fresh by
        :meth:`Cluster.refresh_names` before a decision rests on them; a call that picks a member to act on
        passes False, so a stale address never names one)."""
        if url in self._nodes:
            return self._nodes[url]
        host, port = split_canonical(url)
        return self._on_address(port, addresses | (literal_addresses(host) or frozenset()), learned=learned)

    def _on_address(self, port: int, addresses: frozenset[str], *, learned: bool = True,
                    but: Node | None = None) -> Node | None:
        for node in self._nodes.values():
            known = (literal_addresses(node.host) or frozenset()) | (node.addresses if learned else frozenset())
            if node is not but and node.port == port and addresses & known:
                return node
        return None

    def learn_addresses(self, node: Node, addresses: frozenset[str]) -> Node | None:
        """Record what ``node``'s host name resolved to; returns another member on one of those addresses and
        the same port (one node listed under two spellings), if there is one."""
        node.addresses = addresses
        return self._on_address(node.port, addresses, but=node)

    def named(self) -> list[Node]:
        """Members named by a host name (their addresses come from a lookup and may change)."""
        return [node for node in self._nodes.values() if literal_addresses(node.host) is None]

    def add(self, spec: NodeSpec, source: str, addresses: frozenset[str] = frozenset()) -> Node:
        """Add a member; ``addresses`` are what its host resolved to. Raises :class:`NodeExists` for a URL or an
        address and port that already is a member."""
        existing = self.same_address(spec.url, addresses)
        if existing is not None:
            same = "" if existing.url == spec.url else f" (as {existing.url}: the same address and port)"
            raise NodeExists(f"{spec.url} is already a member{same}", extra={"node": existing.url})
        node = Node(spec, source, self._metrics, addresses)
        self._nodes[node.url] = node
        self._reindex()
        log.info("node %s (%s) added by %s", node.url, node.role.value, source)
        return node

    def remove(self, url: str, reason: str) -> Node:
        node = self._nodes.pop(url, None)
        if node is None:
            raise NodeNotFound(f"{url} is not a member", extra={"node": url})
        node.set_health(NodeHealth.REMOVED)
        labels = {"node": node.url, "role": node.role.value}
        for gauge in (self._metrics.node_healthy, self._metrics.node_serving, self._metrics.node_inflight):
            gauge.remove(*labels.values())
        self._reindex()
        log.info("node %s (%s) removed: %s", node.url, node.role.value, reason)
        return node

    def sync(self, source: str, specs: Iterable[NodeSpec]) -> tuple[list[Node], list[Node]]:
        """Make the members added by ``source`` exactly ``specs``; returns (added, removed)."""
        wanted = {spec.url: spec for spec in specs}
        removed = [self.remove(node.url, f"no longer listed by {source}") for node in list(self._nodes.values())
                   if node.source == source and node.url not in wanted]
        added = []
        for spec in wanted.values():
            existing = self.same_address(spec.url)
            if existing is None:
                added.append(self.add(spec, source))
            elif existing.source != source:
                log.debug("%s: %s is already a member as %s (added by %s)", source, spec.url, existing.url,
                          existing.source)
        return added, removed

    def _reindex(self) -> None:
        for role in Role:
            self._by_role[role] = [node for node in self._nodes.values() if node.role is role]
            self._metrics.nodes.labels(role=role.value).set(len(self._by_role[role]))

"""Which nodes the LB knows: by URL, by address, by role.

A :class:`~lb.node.Node` is created when a flag, DNS discovery or ``POST
/nodes`` adds it and is ``REMOVED`` for good when it leaves; requests already
running on it finish, and stay counted on its URL (:class:`InflightCount`) if
the same URL joins again meanwhile.

Finding the member behind a spelling (an IP literal, ``localhost``, an
address a member's name resolved to) is a lookup in an index by port and
address, not a scan: a DNS answer of thousands of addresses is added in time
linear in its size.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Iterable, Mapping, Sequence

from lb.addresses import literal_addresses, split_canonical
from lb.config import DEFAULT_MAX_NODES, NodeSpec, Role
from lb.errors import NodeExists, NodeNotFound, TooManyNodes
from lb.metrics import LBMetrics
from lb.node import InflightCount, Node, NodeHealth

log = logging.getLogger(__name__)


class Membership:
    """The nodes by URL, in the order they joined, with per-role lists kept for routing."""

    def __init__(self, metrics: LBMetrics, max_nodes: int = DEFAULT_MAX_NODES) -> None:
        self._metrics = metrics
        self.max_nodes = max_nodes
        self._nodes: dict[str, Node] = {}
        self._by_role: dict[Role, list[Node]] = {role: [] for role in Role}
        self._by_literal: dict[tuple[int, str], list[Node]] = {}  # (port, IP) -> members spelled with it
        self._named: list[Node] = []  # members named by a host name (their addresses come from lookups)
        self._join_order: dict[Node, int] = {}
        self._joins = itertools.count()
        self._inflight: dict[str, InflightCount] = {}  # by URL, members' and removed nodes' still busy
        # told of each node that leaves (the cluster closes the pooled connections to it)
        self.on_removed: Callable[[Node], None] | None = None
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
        """The earliest joined member other than ``but`` on ``port`` at one of ``addresses``."""
        found = [node for address in addresses for node in self._by_literal.get((port, address), ())]
        if learned:
            found += [node for node in self._named if node.port == port and addresses & node.addresses]
        found = [node for node in found if node is not but]
        return min(found, key=self._join_order.__getitem__) if found else None

    def learn_addresses(self, node: Node, addresses: frozenset[str]) -> Node | None:
        """Record what ``node``'s host name resolved to; returns another member on one of those addresses and
        the same port (one node listed under two spellings), if there is one."""
        node.addresses = addresses
        return self._on_address(node.port, addresses, but=node)

    def named(self) -> list[Node]:
        """Members named by a host name (their addresses come from a lookup and may change)."""
        return list(self._named)

    def add(self, spec: NodeSpec, source: str, addresses: frozenset[str] = frozenset()) -> Node:
        """Add a member; ``addresses`` are what its host resolved to. Raises :class:`NodeExists` for a URL or an
        address and port that already is a member, :class:`TooManyNodes` when ``max_nodes`` are members."""
        existing = self.same_address(spec.url, addresses)
        if existing is not None:
            same = "" if existing.url == spec.url else f" (as {existing.url}: the same address and port)"
            raise NodeExists(f"{spec.url} is already a member{same}", extra={"node": existing.url})
        if len(self._nodes) >= self.max_nodes:
            raise TooManyNodes(f"the load balancer holds {len(self._nodes)} nodes, its --max-nodes: remove one "
                               f"before adding {spec.url}", extra={"node": spec.url, "max_nodes": self.max_nodes})
        inflight = self._inflight.setdefault(spec.url, InflightCount())
        inflight.on_idle = None
        node = Node(spec, source, self._metrics, inflight, addresses)
        self._nodes[node.url] = node
        self._join_order[node] = next(self._joins)
        for address in node.literal_addresses:
            self._by_literal.setdefault((node.port, address), []).append(node)
        if not node.literal_addresses:
            self._named.append(node)
        self._set_role_list(node.role, [*self._by_role[node.role], node])
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
        del self._join_order[node]
        for address in node.literal_addresses:
            members = [member for member in self._by_literal[(node.port, address)] if member is not node]
            if members:
                self._by_literal[(node.port, address)] = members
            else:
                del self._by_literal[(node.port, address)]
        if node in self._named:
            self._named.remove(node)
        members = self._by_role[node.role].copy()
        members.remove(node)
        self._set_role_list(node.role, members)
        self._forget_inflight_when_idle(url)
        log.info("node %s (%s) removed: %s", node.url, node.role.value, reason)
        if self.on_removed is not None:
            self.on_removed(node)
        return node

    def _forget_inflight_when_idle(self, url: str) -> None:
        """Drop a removed URL's count now, or when its last request ends (unless the URL joined again)."""
        inflight = self._inflight[url]

        def forget() -> None:
            if url not in self._nodes and self._inflight.get(url) is inflight:
                del self._inflight[url]

        if inflight.value == 0:
            forget()
        else:
            inflight.on_idle = forget

    def sync(self, listings: Mapping[str, Sequence[NodeSpec]]) -> dict[str, tuple[list[Node], list[Node]]]:
        """Make the members each source of ``listings`` added exactly its specs, as many as ``max_nodes`` leaves
        room for (the first listed; the rest are logged and left out); returns each source's (added, removed).

        The sources are synced together: a member that its source no longer lists and another lists as the same
        node (URL, role, bootstrap port) passes to that source as it is (its health, fences and requests), and
        every source's removals come before any addition, so an address one source dropped and another lists
        under another role is that role's member at once, whatever the order of the sources."""
        wanted = {source: {spec.url: spec for spec in specs} for source, specs in listings.items()}
        for node in list(self._nodes.values()):
            if node.source in wanted and node.url not in wanted[node.source]:
                heir = next((source for source, specs in wanted.items() if _is_same(specs.get(node.url), node)),
                            None)
                if heir is not None:
                    log.info("node %s (%s): no longer listed by %s, kept as listed by %s", node.url,
                             node.role.value, node.source, heir)
                    node.source = heir
        removed = {source: self._drop_unlisted(source, specs) for source, specs in wanted.items()}
        return {source: (self._add_listed(source, specs.values()), removed[source])
                for source, specs in wanted.items()}

    def _drop_unlisted(self, source: str, wanted: Mapping[str, NodeSpec]) -> list[Node]:
        """Remove the members ``source`` added that it no longer lists, or that another source's member is."""
        removed = [self.remove(node.url, f"no longer listed by {source}") for node in list(self._nodes.values())
                   if node.source == source and node.url not in wanted]
        for node in [node for node in self._nodes.values() if node.source == source]:
            twin = self._on_address(node.port, node.literal_addresses, but=node)  # a name that moved onto it
            if twin is not None and twin.source != source:
                removed.append(self.remove(node.url, f"the same address and port as {twin.url} (added by "
                                                     f"{twin.source})"))
        return removed

    def _add_listed(self, source: str, specs: Iterable[NodeSpec]) -> list[Node]:
        """Add what ``source`` lists that is no member yet (under any spelling), while ``max_nodes`` leaves room."""
        added, left_out = [], []
        for spec in specs:
            existing = self.same_address(spec.url)
            if existing is None and len(self._nodes) >= self.max_nodes:
                left_out.append(spec.url)
            elif existing is None:
                added.append(self.add(spec, source))
            elif existing.source != source:
                log.debug("%s: %s is already a member as %s (added by %s)", source, spec.url, existing.url,
                          existing.source)
        if left_out:
            log.warning("%s: %d node(s) left out, the load balancer holds --max-nodes (%d): %s%s", source,
                        len(left_out), self.max_nodes, ", ".join(left_out[:5]), ", ..." if len(left_out) > 5 else "")
        return added

    def _set_role_list(self, role: Role, members: list[Node]) -> None:
        """A new list, never the old one changed: a caller iterating the old one is not disturbed."""
        self._by_role[role] = members
        self._metrics.nodes.labels(role=role.value).set(len(members))


def _is_same(spec: NodeSpec | None, node: Node) -> bool:
    """Whether ``spec`` lists ``node`` as it is (its role and bootstrap port)."""
    return spec is not None and spec.role is node.role and spec.bootstrap_port == node.bootstrap_port

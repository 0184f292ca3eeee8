"""DNS discovery: every address of a (Kubernetes headless) service name is a node.

Each ``--discover-dns ROLE=HOST:PORT`` target is resolved every
``--discover-interval`` seconds; the nodes it found are exactly the members it
added (another source's node at the same URL is left alone). A lookup that
fails or does not answer within :data:`LOOKUP_TIMEOUT_S` keeps the target's
current nodes, so a DNS hiccup does not empty the cluster; an answer with no
address removes them all. Every target is looked up at once, and the membership
synced with all their answers together (a node one target dropped and another
lists stays a member). The resolver is a plain
async callable, so tests can give their own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

from lb.addresses import Resolver, system_resolver
from lb.config import DnsTarget, NodeSpec
from lb.membership import Membership
from lb.node import Node

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 5.0  # a lookup not answered by then fails: its target's nodes stay until the next round


def node_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class DnsDiscovery:
    def __init__(self, targets: Sequence[DnsTarget], membership: Membership, interval_s: float,
                 resolver: Resolver | None = None,
                 on_added: Callable[[list[Node]], Awaitable[None]] | None = None,
                 before_sync: Callable[[], Awaitable[None]] | None = None) -> None:
        """``before_sync`` runs before each round's changes (the cluster re-resolves its named members, so an
        address a name no longer has never hides a new node)."""
        self._targets = list(targets)
        self._membership = membership
        self._interval_s = interval_s
        self._resolver = resolver or system_resolver
        self._on_added = on_added
        self._before_sync = before_sync

    async def run(self) -> None:
        """Refresh every interval until cancelled (the first refresh is :meth:`refresh`, at start)."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop discovery for good
                log.exception("DNS discovery round failed")

    async def refresh(self) -> None:
        """One round: every target looked up at once (each within :data:`LOOKUP_TIMEOUT_S`), then the
        membership made what they all list (:meth:`Membership.sync`)."""
        if self._before_sync is not None:
            await self._before_sync()
        found = await asyncio.gather(*(self._lookup(target) for target in self._targets))
        listings = {f"dns {target}": specs for target, specs in zip(self._targets, found) if specs is not None}
        added: list[Node] = []
        for source, (new, removed) in self._membership.sync(listings).items():
            if new or removed:
                log.info("%s: %d address(es); added %s; removed %s", source, len(listings[source]),
                         [node.url for node in new] or "none", [node.url for node in removed] or "none")
            added.extend(new)
        if added and self._on_added is not None:
            await self._on_added(added)

    async def _lookup(self, target: DnsTarget) -> list[NodeSpec] | None:
        """The nodes ``target`` lists now; None when its lookup failed or did not answer in time (its nodes
        stay)."""
        source = f"dns {target}"
        try:
            addresses = await asyncio.wait_for(self._resolver(target.host, target.port), LOOKUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("%s: no answer within %g s, keeping its current nodes", source, LOOKUP_TIMEOUT_S)
            return None
        except (OSError, ValueError) as exc:  # ValueError: a name the resolver cannot encode (UnicodeError)
            log.warning("%s: lookup failed, keeping its current nodes: %s", source, exc)
            return None
        specs = []
        for address in addresses:
            try:
                specs.append(NodeSpec(node_url(address, target.port), target.role, target.bootstrap_port))
            except ValueError as exc:  # one address no node URL can hold (a zone index) leaves the others alone
                log.warning("%s: leaving out %r: %s", source, address[:100], exc)
        return specs

"""DNS discovery: every address of a (Kubernetes headless) service name is a node.

Each ``--discover-dns ROLE=HOST:PORT`` target is resolved every
``--discover-interval`` seconds; the nodes it found are exactly the members it
added (another source's node at the same URL is left alone). A lookup that
fails keeps the target's current nodes, so a DNS hiccup does not empty the
cluster; an answer with no address removes them all. The resolver is a plain
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
        if self._before_sync is not None:
            await self._before_sync()
        added: list[Node] = []
        for target in self._targets:
            added.extend(await self._refresh_target(target))
        if added and self._on_added is not None:
            await self._on_added(added)

    async def _refresh_target(self, target: DnsTarget) -> list[Node]:
        source = f"dns {target}"
        try:
            addresses = await self._resolver(target.host, target.port)
        except (OSError, ValueError) as exc:  # ValueError: a name the resolver cannot encode (UnicodeError)
            log.warning("%s: lookup failed, keeping its current nodes: %s", source, exc)
            return []
        specs = []
        for address in addresses:
            try:
                specs.append(NodeSpec(node_url(address, target.port), target.role, target.bootstrap_port))
            except ValueError as exc:  # one address no node URL can hold (a zone index) leaves the others alone
                log.warning("%s: leaving out %r: %s", source, address[:100], exc)
        added, removed = self._membership.sync(source, specs)
        if added or removed:
            log.info("%s: %d address(es); added %s; removed %s", source, len(specs),
                     [node.url for node in added] or "none", [node.url for node in removed] or "none")
        return added

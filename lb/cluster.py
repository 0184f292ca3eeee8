"""The LB's parts wired together, with one lifecycle: created, running, stopped.

Starting opens the process's one upstream client, checks every configured
node once (so the first request is routed by real state), runs the first DNS
lookup, then leaves the health and discovery loops running; stopping cancels
the loops and closes the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from dataclasses import dataclass

from handoff.service.auth import BearerToken, admin_token_of
from handoff.service.upstream import UpstreamClient
from lb.addresses import Resolver, resolve, split_canonical
from lb.config import LBConfig, NodeSpec
from lb.discovery import DnsDiscovery
from lb.errors import NodeNotFound
from lb.fanout import FanOut
from lb.health import HealthMonitor
from lb.membership import Membership
from lb.metrics import LBMetrics
from lb.node import Node
from lb.proxy import GenerationProxy
from lb.relay import NodeCaller
from lb.routing import Router

log = logging.getLogger(__name__)


class ClusterState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


@dataclass(frozen=True)
class _Parts:
    """What exists only while running (it needs the event loop)."""

    client: UpstreamClient
    health: HealthMonitor
    fanout: FanOut
    proxy: GenerationProxy


class Cluster:
    """Membership, health, fan-out and generation routing over one pooled client."""

    def __init__(self, config: LBConfig, metrics: LBMetrics, *, resolver: Resolver | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.state = ClusterState.CREATED
        self.node_headers = BearerToken(admin_token_of(config.admin_token, config.api_key)).header()
        self.membership = Membership(metrics, config.max_nodes)
        for spec in config.nodes:
            self.membership.add(spec, "flag")
        self.router = Router(self.membership, config.policy, retry_after_s=max(1.0, config.health_interval_s))
        self._resolver = resolver
        self._tasks: list[asyncio.Task[None]] = []
        self._parts: _Parts | None = None

    def _running(self) -> _Parts:
        if self.state is not ClusterState.RUNNING or self._parts is None:
            raise RuntimeError(f"the cluster is {self.state.value}, not running")
        return self._parts

    @property
    def health(self) -> HealthMonitor:
        return self._running().health

    @property
    def client(self) -> UpstreamClient:
        """The process's one pooled client (for calls to one node outside a fan-out)."""
        return self._running().client

    @property
    def fanout(self) -> FanOut:
        return self._running().fanout

    @property
    def proxy(self) -> GenerationProxy:
        return self._running().proxy

    async def start(self) -> None:
        if self.state is not ClusterState.CREATED:
            raise RuntimeError(f"the cluster is {self.state.value}; it starts only once")
        config = self.config
        client = UpstreamClient(connect_timeout_s=config.connect_timeout_s)
        health = HealthMonitor(client, self.membership, config, self.node_headers)
        caller = NodeCaller(client, health, self.metrics, config.generate_timeout_s, config.max_answer_bytes)
        self._parts = _Parts(client, health,
                             FanOut(client, self.membership, health, self.metrics, self.node_headers),
                             GenerationProxy(self.membership, self.router, caller, self.node_headers))
        self.state = ClusterState.RUNNING
        # an idle connection to a node that left would stay open until its peer closed it (a dead node never does)
        self.membership.on_removed = lambda node: client.close_idle(node.url)
        await self._resolve_flag_names()
        await health.check_many(self.membership.nodes())
        self._tasks.append(asyncio.ensure_future(health.run()))
        if config.discover_dns:
            discovery = DnsDiscovery(config.discover_dns, self.membership, config.discover_interval_s,
                                     self._resolver, on_added=health.check_many, before_sync=self.refresh_names)
            await discovery.refresh()
            self._tasks.append(asyncio.ensure_future(discovery.run()))
        log.info("load balancer running with %d node(s), policy %s", len(self.membership), config.policy.value)

    async def _resolve_flag_names(self) -> None:
        """What each flag node named by a host name stands for, so that another spelling of it (``POST /nodes``,
        DNS discovery, a second flag) is known as the same node; of two flag nodes found to be one, the first
        listed stays."""
        named = self.membership.named()
        found = await asyncio.gather(*(resolve(node.host, self._resolver) for node in named))
        order = {node.url: index for index, node in enumerate(self.membership.nodes())}
        for node, addresses in zip(named, found):
            if node.is_removed:
                continue
            twin = self.membership.learn_addresses(node, addresses)
            if twin is not None:
                kept, dropped = (twin, node) if order[twin.url] < order[node.url] else (node, twin)
                log.warning("%s and %s are the same address and port: one node, kept as %s", kept.url,
                            dropped.url, kept.url)
                self.membership.remove(dropped.url, f"the same node as {kept.url}")

    async def refresh_names(self) -> None:
        """Resolve the members named by host names again: a name's addresses move (Kubernetes reuses pod IPs),
        and an old address must not make another node look like a member."""
        named = self.membership.named()
        found = await asyncio.gather(*(resolve(node.host, self._resolver) for node in named))
        for node, addresses in zip(named, found):
            if not node.is_removed and addresses:  # a name that does not resolve now keeps what it had
                self.membership.learn_addresses(node, addresses)

    async def stop(self) -> None:
        if self.state is ClusterState.STOPPED:
            return
        self.state = ClusterState.STOPPED
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._parts is not None:
            await self._parts.client.aclose()

    async def add_node(self, spec: NodeSpec) -> Node:
        """Add a node at run time (one node under two spellings of its address is one node) and check it once
        before answering."""
        addresses = await resolve(split_canonical(spec.url)[0], self._resolver)
        await self.refresh_names()
        node = self.membership.add(spec, "admin", addresses)
        try:
            await self.health.check(node)
        except BaseException:  # a member must never be left behind by a call that failed
            self.membership.remove(node.url, "its first check failed")
            raise
        if node.is_removed:
            raise NodeNotFound(f"{node.url} was removed while its first check ran", extra={"node": node.url})
        return node

"""The cluster's weight versions as the LB reports them: ``GET /get_weight_version`` (every node's version, checked
now, and whether they agree) and SGLang's ``/model_info`` of one serving node with the cluster's version."""

from __future__ import annotations

from typing import Any

from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import UpstreamClient, UpstreamError
from lb.errors import NoAvailableNode, NoNodes
from lb.health import HealthMonitor
from lb.membership import Membership
from lb.node import NodeHealth

MAX_INFO_BYTES = 64 * 1024


class WeightVersions:
    def __init__(self, membership: Membership, health: HealthMonitor) -> None:
        self._membership = membership
        self._health = health

    async def weight_versions(self) -> dict[str, Any]:
        """Every node's version (checked now) and whether the nodes that answered agree; ``weight_version`` is
        null if they do not. A node that is not healthy serves no version: what it reported before it went down
        is not shown as what it serves (``GET /memory_occupation`` counts only healthy nodes' versions too)."""
        nodes = self._membership.nodes()
        await self._health.check_many(nodes)
        versions = [{"node": node.url, "role": node.role.value, "health": node.health.value,
                     "weight_version": node.occupation.get("weight_version")
                     if node.health is NodeHealth.HEALTHY else None} for node in nodes]
        reported = [entry["weight_version"] for entry in versions if entry["health"] == NodeHealth.HEALTHY.value]
        # a node's state is a peer's JSON: a version that is neither a string nor null agrees with nothing
        distinct = set(reported) if all(v is None or isinstance(v, str) for v in reported) else set()
        consistent = len(distinct) == 1
        return {"weight_version": next(iter(distinct)) if consistent else None, "consistent": consistent,
                "nodes": versions}

    async def model_info(self, client: UpstreamClient, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """SGLang's ``/model_info`` of one serving node, with the cluster's ``weight_version`` (null when the
        nodes disagree) and every node's in ``weight_versions``."""
        versions = await self.weight_versions()
        nodes = [n for n in self._membership.nodes() if n.is_routable] or list(self._membership.nodes())
        if not nodes:
            raise NoNodes("no nodes to send /model_info to")
        last_error = "no node answered"
        for node in nodes:
            try:
                response = await client.request("GET", node.url + "/model_info", headers=headers, timeout=timeout_s)
                async with response:
                    raw = await response.read_whole(MAX_INFO_BYTES)
                info = loads_bounded(raw) if response.status == 200 else None
            except (UpstreamError, PeerJSONError) as exc:
                last_error = f"{node.url}: {exc}"
                continue
            if isinstance(info, dict):
                return {**info, "weight_version": versions["weight_version"], "weight_versions": versions}
            last_error = f"{node.url} answered {response.status}"
        raise NoAvailableNode(f"no node could tell its model info ({last_error})", retry_after=1)

"""The cluster's weight versions as the LB reports them: ``GET /get_weight_version`` (every node's version, checked
now, and whether they agree) and SGLang's ``/model_info`` of one node with the cluster's version (the node asked
as :class:`lb.probes.Probes` asks every probe path)."""

from __future__ import annotations

from typing import Any

from lb.errors import NoNodes
from lb.health import HealthMonitor
from lb.membership import Membership
from lb.node import NodeHealth
from lb.probes import Probes


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

    async def model_info(self, probes: Probes) -> dict[str, Any]:
        """SGLang's ``/model_info`` of one node (asked as the other probes are: any healthy node, serving nodes
        first; when none answers an object, 502 ``upstream_error`` naming each), with the cluster's
        ``weight_version`` (null when the nodes disagree) and every node's in ``weight_versions``."""
        if not self._membership.nodes():
            raise NoNodes("no nodes to send /model_info to")
        versions = await self.weight_versions()
        _, info = await probes.ask_object("/model_info")
        return {**info, "weight_version": versions["weight_version"], "weight_versions": versions}

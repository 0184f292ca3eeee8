"""The cluster as ``GET /nodes`` and ``GET /memory_occupation`` show it."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

from handoff.protocol.tags import TAG_NAMES as TAGS
from handoff.protocol.tags import TAG_STATE_NAMES as TAG_STATES
from handoff.protocol.tags import is_byte_count
from lb.node import Node, NodeHealth


def _kind(node: Node) -> str:
    return {True: "sidecar", False: "plain", None: "unknown"}[node.is_sidecar]


def node_tags(node: Node) -> dict[str, dict[str, Any]]:
    """Per tag ``{"state", "bytes"}`` as the node last reported it (empty for plain servers)."""
    tags = node.occupation.get("tags")
    if not isinstance(tags, Mapping):
        return {}
    return {name: {"state": tag.get("state"), "bytes": tag.get("bytes")}
            for name, tag in tags.items() if isinstance(tag, Mapping)}


def node_view(node: Node) -> dict[str, Any]:
    occupation = node.occupation
    return {
        "url": node.url,
        "role": node.role.value,
        "bootstrap_port": node.bootstrap_port,
        "source": node.source,
        "kind": _kind(node),
        "engine_kind": occupation.get("engine_kind"),  # handoff, vllm, sglang: as the node's sidecar says
        "health": node.health.value,
        "routable": node.is_routable,
        "serving": node.is_serving,
        "not_serving_reason": occupation.get("not_serving_reason"),  # a sidecar's word on why it does not serve
        "admission": node.admission,
        "tags": node_tags(node),
        "weights_valid": occupation.get("weights_valid"),
        "weight_version": occupation.get("weight_version"),
        "tp_size": occupation.get("tp_size"),  # its ranks in a weight update group
        "in_flight": node.num_inflight,
        "node_in_flight": occupation.get("in_flight"),
        "held": occupation.get("held"),
        "last_error": node.last_error,
        "last_seen": node.last_seen,
    }


def cluster_occupation(nodes: Iterable[Node]) -> dict[str, Any]:
    """Per tag: how many nodes are in each state (``unknown``: no report) and the bytes they hold."""
    nodes = list(nodes)
    tags: dict[str, dict[str, int]] = {tag: {**{s: 0 for s in TAG_STATES}, "unknown": 0, "bytes": 0}
                                       for tag in TAGS}
    weight_versions: Counter[str] = Counter()
    device_free = device_total = 0
    for node in nodes:
        reported = node_tags(node) if node.health is NodeHealth.HEALTHY else {}
        for tag, row in tags.items():
            state = reported.get(tag, {}).get("state")
            row[state if state in TAG_STATES else "unknown"] += 1
            num_bytes = reported.get(tag, {}).get("bytes")
            row["bytes"] += _byte_count(num_bytes)
        if node.health is NodeHealth.HEALTHY:
            version = node.occupation.get("weight_version")
            if isinstance(version, str):
                weight_versions[version] += 1
            device = node.occupation.get("device")
            if isinstance(device, Mapping):
                device_free += _byte_count(device.get("free_bytes"))
                device_total += _byte_count(device.get("total_bytes"))
    return {
        "total": len(nodes),
        "healthy": sum(node.health is NodeHealth.HEALTHY for node in nodes),
        "serving": sum(node.is_routable for node in nodes),
        "tags": tags,
        "weight_versions": dict(weight_versions),
        "device": {"free_bytes": device_free, "total_bytes": device_total},
    }


def _byte_count(value: object) -> int:
    """A node's byte count, summed over nodes: 0 unless :func:`is_byte_count` (``true``, ``-5`` or a 4,300-digit
    number are none: their sum was written as a number no JSON reader takes)."""
    return value if is_byte_count(value) else 0

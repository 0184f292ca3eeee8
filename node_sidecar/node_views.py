"""What a node tells of itself without asking its engine: ``/memory_occupation``'s view, the state header the LB
routes by, and the memory gauges (:class:`~node_sidecar.node.Node`'s state, read only)."""

from __future__ import annotations

import json
from typing import Any

from handoff.protocol.control import MAX_NODE_STATE_HEADER_BYTES
from node_sidecar.node import Node
from node_sidecar.state import TAGS, TagState

__all__ = ["state_view", "state_header", "update_memory_metrics"]


def state_view(node: Node) -> dict[str, Any]:
    """What the node knows of itself without asking the engine; the LB routes by it.

    Until the engine's own view was read (at start, and again after it was
    unreachable) the tags' states are not known: a restarted sidecar or
    engine must not report what it merely assumes.
    """
    state = node.state
    serving = state.is_serving and node.admission.is_open
    tags = ({t: {"state": "unknown" if t in state.unknown_tags else state.tags[t].value,
                 "bytes": None if t in state.unknown_tags else state.tag_bytes[t]} for t in TAGS}
            if state.is_synced else {t: {"state": "unknown", "bytes": None} for t in TAGS})
    return {
        "role": node.config.role,
        "engine_kind": None if node.adapter is None else node.adapter.kind.value,
        "serving": serving,
        "not_serving_reason": None if serving else state.not_serving_reason().value,
        "admission": node.admission.view,
        "engine_reachable": state.is_engine_reachable,
        "paused": state.is_paused,
        "tags": tags,
        "weights_valid": state.weights_valid,
        "weight_version": state.weight_version,
        "weights_backup": state.weights_backup,
        "tp_size": state.tp_size,
        "weight_groups_lost": sorted(state.intent.lost_groups),  # left with an engine that restarted
        "in_flight": node.admission.num_in_flight,
        "held": node.admission.num_held,
        "last_error": node.last_error,
        "engine_health_misses": node.health_misses,
    }


def state_header(node: Node) -> bytes | None:
    """:func:`state_view` for :data:`NODE_STATE_HEADER` (routing fields only), or None if too large."""
    view = state_view(node)
    del view["last_error"], view["engine_health_misses"]
    value = json.dumps(view, separators=(",", ":")).encode()  # ASCII: a valid header value
    return value if len(value) <= MAX_NODE_STATE_HEADER_BYTES else None


def update_memory_metrics(node: Node) -> None:
    """Set ``handoff_node_memory_bytes`` from what the node knows now (at each scrape). Until the engine's
    view is read (at start, and again after it was unreachable) there are no series: as in
    :func:`state_view`, a dead or restarted engine's memory is not known, and must not be summed."""
    if not node.state.is_synced:
        node.metrics.memory_bytes.clear()
        return
    for tag in TAGS:
        current = node.state.tags[tag]
        for state in TagState:
            node.metrics.memory_bytes.labels(tag, state.value).set(
                node.state.tag_bytes[tag] if current is state else 0)

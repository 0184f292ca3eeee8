"""The node's memory state per tag, as the sidecar knows it.

Each tag moves ``resident → releasing → released → resuming → resident``; a
release that fails goes back ``releasing → resident`` and a resume that fails
``resuming → released``. Any other move is a bug and raises, naming the state
it was in. After the engine was unreachable the whole view is rebuilt from
the engine (its adapter's :meth:`~node_sidecar.engines.base.EngineAdapter.read_view`), never assumed;
what the cluster asked of a node whose engine restarted is :mod:`node_sidecar.intent`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from handoff.protocol.control import peer_weight_version
from handoff.protocol.errors import NotServingReason
from handoff.protocol.tags import TAG_NAMES as TAGS
from handoff.protocol.tags import TagState
from node_sidecar.intent import ClusterIntent

if TYPE_CHECKING:
    from node_sidecar.engines.base import EngineView


_ALLOWED = {
    TagState.RESIDENT: {TagState.RELEASING},
    TagState.RELEASING: {TagState.RELEASED, TagState.RESIDENT},
    TagState.RELEASED: {TagState.RESUMING},
    TagState.RESUMING: {TagState.RESIDENT, TagState.RELEASED},
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class NodeState:
    tags: dict[str, TagState] = field(default_factory=lambda: {t: TagState.RESIDENT for t in TAGS})
    tag_bytes: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TAGS})
    weights_valid: bool = False
    weight_version: str | None = None
    weights_backup: str = "none"
    memory_saver: str = "off"
    can_stage_weights: bool = False  # stage_to_cpu: true can be honoured
    is_engine_reachable: bool = False
    is_synced: bool = False          # the view was read from the engine since it (re)appeared
    is_paused: bool = False          # pause_generation without a continue
    is_engine_paused: bool = False   # ... one the engine itself holds (retract, in_place): a continue must reach it
    tp_size: int = 1                 # ranks in a weight update group (the LB hands out rank offsets by it)
    unknown_tags: frozenset[str] = frozenset()  # released as far as admission goes; no call may touch them
    unknown_reason: str | None = None  # why their state is not known, and the way out
    intent: ClusterIntent = field(default_factory=ClusterIntent)  # what the cluster asked, across engine restarts

    def transition(self, tag: str, new: TagState) -> None:
        old = self.tags[tag]
        if new not in _ALLOWED[old]:
            raise IllegalTransition(f"tag {tag}: cannot go from {old.value} to {new.value}")
        self.tags[tag] = new

    def sync(self, view: EngineView) -> None:
        """Adopt the engine's own view (read by the node's engine adapter)."""
        self.tags.update(view.tags)
        self.tag_bytes.update(view.tag_bytes)
        self.weights_valid = view.weights_valid
        self.weight_version = peer_weight_version(view.weight_version)
        self.weights_backup = view.weights_backup
        self.memory_saver = view.memory_saver
        self.can_stage_weights = view.can_stage_weights
        self.tp_size = view.tp_size
        self.unknown_tags, self.unknown_reason = view.unknown, view.unknown_reason
        if view.paused:  # requests the engine keeps paused (retract, in_place) wait for a continue
            self.is_paused = self.is_engine_paused = True
        self.is_synced = True

    def tags_in(self, state: TagState) -> list[str]:
        return [t for t in TAGS if self.tags[t] is state]

    @property
    def is_all_resident(self) -> bool:
        return all(s is TagState.RESIDENT for s in self.tags.values())

    @property
    def is_serving(self) -> bool:
        return (self.is_engine_reachable and self.is_synced and self.is_all_resident and self.weights_valid
                and not self.is_paused and self.intent.blocking_reason() is None)

    def not_serving_reason(self) -> NotServingReason:
        """Why a generation gets a 503 while the node is not serving."""
        if not self.is_engine_reachable or not self.is_synced:
            return NotServingReason.ENGINE_UNAVAILABLE
        if not self.is_all_resident:
            return NotServingReason.NODE_RELEASED
        blocked = self.intent.blocking_reason()
        if blocked is not None:
            return blocked
        if not self.weights_valid:
            return NotServingReason.WEIGHTS_NOT_LOADED
        if self.is_paused:
            return NotServingReason.GENERATION_PAUSED
        return NotServingReason.NODE_RELEASED  # SPEC: a release drains behind a closed admission, 503 node_released

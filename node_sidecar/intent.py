"""What the cluster last asked of the node, kept across a restart of its engine (not of the sidecar).

A fresh engine process starts with every tag resident and its start checkpoint
loaded, whatever the cluster did to the one before it. The sidecar therefore
remembers, from the control calls that succeeded through it, which tags the
cluster released (and has not resumed) and whether the node's weights came from
an update since its engine started. When the engine reports another process
identity (``engine_instance`` of handoff's engine, SGLang's ``startup_time``,
vLLM's ``instance_id``), the node does not serve the fresh engine as it comes
up: the released tags are released again first (:attr:`ClusterIntent.unrestored`
until done), and a node whose weights had been updated refuses generation with
``weights_stale`` until a weight update or a reload through the sidecar
succeeds. Renaming the version (``update_weight_version``) does not lift it: it
would only label the start checkpoint's weights with the new name.

A fresh engine is in no weight update group either: the groups its predecessor
joined through the sidecar become :attr:`ClusterIntent.lost_groups` until the
trainer destroys them (a success: the node holds them no more) or joins them
again. An update over a lost group is refused at once (``weight_sync_broken``):
its trainer must form the group again, on every node.

A restarted sidecar starts with nothing remembered: it reads the tags from the
engine as before, and cannot tell whether that engine's weights are stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from handoff.protocol.errors import NotServingReason
from handoff.protocol.tags import TAG_NAMES as TAGS


@dataclass(frozen=True)
class StaleWeights:
    """A fresh engine serves ``served`` (its start checkpoint's version); the node had ``had``."""

    served: str | None
    had: str | None

    def message(self) -> str:
        return (f"the engine restarted and serves its start checkpoint (weight_version {self.served!r}), but the "
                f"node's weights had been updated (weight_version {self.had!r}): not serving until a weight update "
                "or update_weights_from_disk through the sidecar succeeds")


@dataclass
class ClusterIntent:
    released: set[str] = field(default_factory=set)  # released by control calls, not resumed since
    weights_updated: bool = False      # the engine process's weights came from an update, not its start checkpoint
    engine: str | None = None          # the engine process this holds for (None: none identified yet)
    unrestored: list[str] = field(default_factory=list)  # released tags a fresh engine holds resident still
    stale: StaleWeights | None = None  # a fresh engine's start weights, where the node had updated ones
    stage_to_cpu: bool | None = None   # as the cluster's last release asked (a vLLM node's sleep level follows it)
    joined_groups: set[str] = field(default_factory=set)  # weight groups this engine process joined through us
    lost_groups: set[str] = field(default_factory=set)    # joined by an earlier engine process, not left since

    def record_release(self, tags: list[str], *, stage_to_cpu: bool | None = None) -> None:
        """``tags`` are released now, as the cluster asked; ``stage_to_cpu`` as it asked, kept for a release again
        when the call released a tag not released before (a repeated release changes nothing)."""
        if not self.released.issuperset(tags):
            self.stage_to_cpu = stage_to_cpu
        self.released.update(tags)
        self.unrestored = [t for t in self.unrestored if t not in tags]

    def record_resume(self, tags: list[str]) -> None:
        """``tags`` are resident now, as the cluster asked (one never released again on a fresh engine may stay)."""
        self.released.difference_update(tags)
        self.unrestored = [t for t in self.unrestored if t not in tags]

    def record_weights_loaded(self) -> None:
        """A weight update or a reload succeeded: the engine serves the weights the cluster sent."""
        self.weights_updated = True
        self.stale = None

    def record_joined(self, group: str) -> None:
        """The engine joined weight group ``group``."""
        self.joined_groups.add(group)
        self.lost_groups.discard(group)

    def record_left(self, group: str) -> None:
        """The node is in weight group ``group`` no more (destroyed, or lost with an engine and so acknowledged)."""
        self.joined_groups.discard(group)
        self.lost_groups.discard(group)

    def meet_engine(self, instance: str | None, *, served_version: str | None, had_version: str | None) -> bool:
        """Note the engine process read now; True if it is a fresh one replacing the process this held for (then
        :attr:`unrestored` and :attr:`stale` say what the node must do before it serves). An engine that names
        no process, and the first one seen, are taken as they are."""
        if instance is None or instance == self.engine:
            return False
        first, self.engine = self.engine is None, instance
        if first:
            return False
        self.unrestored = [t for t in TAGS if t in self.released]
        self.lost_groups |= self.joined_groups
        self.joined_groups = set()
        if self.weights_updated or self.stale is not None:
            self.stale = StaleWeights(served_version, self.stale.had if self.stale is not None else had_version)
        self.weights_updated = False
        return True

    def restored(self, tags: list[str]) -> None:
        """The fresh engine released ``tags`` again (the unrestored ones and any freed together with them)."""
        self.record_release(tags, stage_to_cpu=self.stage_to_cpu)
        self.unrestored = []

    def lost_group_message(self, group: str) -> str:
        """Why an update over ``group``, lost with an earlier engine process, is refused, and what to do."""
        return (f"the engine restarted after it joined weight group {group!r} (engine process {self.engine}) and "
                "is in no group now: the group is out of step; destroy it on every node "
                "(destroy_weights_update_group) and call init_weights_update_group again")

    def blocking_reason(self) -> NotServingReason | None:
        """Why the node may not serve its fresh engine yet (None: nothing of the cluster's stands in the way)."""
        if self.unrestored:
            return NotServingReason.NODE_RELEASED
        if self.stale is not None:
            return NotServingReason.WEIGHTS_STALE
        return None

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
succeeds; for handoff's engine and vLLM, until updates have written every weight of
the fresh process (its answers' ``weights_updated_fully``: a trainer's buckets
each write a part). Renaming the version (``update_weight_version``) does not lift it: it
would only label the start checkpoint's weights with the new name.

A fresh engine is in no weight update group either: the groups its predecessor
joined through the sidecar become :attr:`ClusterIntent.lost_groups` until the
trainer destroys them (a success: the node holds them no more) or joins them
again. An update over a lost group is refused at once (``weight_sync_broken``):
its trainer must form the group again, on every node.

A restarted sidecar starts with nothing remembered (it reads the tags from the
engine as before and keeps those it holds released as the cluster's; handoff's
engine also says whether an update wrote its weights since it started, its
``/memory_occupation``'s ``weights_updated``, which is kept the same way; of a
vLLM or SGLang engine it cannot tell, and serves a later fresh engine's start
checkpoint), unless it was given ``--state-file``: then every change is written there
(:mod:`node_sidecar.intent_file`, through :attr:`ClusterIntent.on_change`) and
read back at start, so a sidecar restarted together with its engine meets the
fresh engine as one restarted alone.

A pause the sidecar makes itself (``pause_generation`` modes ``wait`` and ``abort``: the engine knows nothing
of it) is kept there too (:attr:`ClusterIntent.paused`), so a restarted sidecar holds generation until the
cluster's ``continue_generation``; a pause the engine holds (``retract``, ``in_place``) is read from the engine.

An engine that does not say which of its tags it has released (SGLang) has them
recorded there too (:class:`TagRecord`): the tags its adapter holds released
on one engine process, and those of a memory call under way, recorded before the
call is sent (and a ``continue_generation`` it holds back). A sidecar restarted
alone takes them from the record when it meets the same process
(:meth:`~node_sidecar.engines.foreign.ForeignEngine.recall`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, TypeVar, cast

from handoff.protocol.control import MAX_NAME_CHARS
from handoff.protocol.errors import NotServingReason
from handoff.protocol.tags import TAG_NAMES as TAGS
from node_sidecar.tag_record import MAX_ENGINE_CHARS, IntentShapeError, TagRecord, tag_list, text_field

__all__ = ["MAX_ENGINE_CHARS", "MAX_GROUPS", "STATE_FORMAT", "ClusterIntent", "IntentShapeError", "StaleWeights",
           "TagRecord"]

STATE_FORMAT = 1
MAX_GROUPS = 16          # weight groups kept per list (a trainer forms one or two); past it only engine_memory is kept
_KEYS = ("format", "engine", "released", "stage_to_cpu", "unrestored", "weights_updated", "weight_version",
         "stale", "joined_groups", "lost_groups")
_NEWER_KEYS = ("engine_memory", "paused")  # absent from a file written before them: read as null, false

F = TypeVar("F", bound=Callable[..., Any])


def _recorded(method: F) -> F:
    """A method that changes the intent: :attr:`ClusterIntent.on_change` hears of it once it is done."""
    @functools.wraps(method)
    def changing(self: ClusterIntent, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if self.on_change is not None:
            self.on_change(self)
        return result
    return cast(F, changing)


@dataclass(frozen=True)
class StaleWeights:
    """A fresh engine serves ``served`` (its start checkpoint's version); the node had ``had``."""

    served: str | None
    had: str | None

    def message(self) -> str:
        return (f"the engine restarted and serves its start checkpoint (weight_version {self.served!r}), but the "
                f"node's weights had been updated (weight_version {self.had!r}): not serving until weight updates "
                "through the sidecar have replaced every weight, or update_weights_from_disk succeeds")


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
    weight_version: str | None = None  # the node's version when an update last succeeded (named if stale later)
    engine_memory: TagRecord | None = None  # an adapter's own record of an engine process's tags (SGLang's)
    paused: bool = False               # generation paused by the sidecar itself (pause modes wait, abort)
    on_change: Callable[[ClusterIntent], None] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The intent as JSON (what ``--state-file`` holds); :meth:`from_json` reads it back."""
        return {"format": STATE_FORMAT, "engine": self.engine, "released": [t for t in TAGS if t in self.released],
                "stage_to_cpu": self.stage_to_cpu, "unrestored": list(self.unrestored),
                "weights_updated": self.weights_updated, "weight_version": self.weight_version,
                "stale": None if self.stale is None else {"served": self.stale.served, "had": self.stale.had},
                "joined_groups": sorted(self.joined_groups), "lost_groups": sorted(self.lost_groups),
                "engine_memory": None if self.engine_memory is None else self.engine_memory.to_json(),
                "paused": self.paused}

    @classmethod
    def from_json(cls, data: object, *, on_change: Callable[[ClusterIntent], None] | None = None) -> ClusterIntent:
        """The intent :meth:`to_json` wrote; raises :class:`IntentShapeError` naming the first field that is not of
        its shape, type or bounds (any key missing or extra included)."""
        if not isinstance(data, dict) or sorted(k for k in data if k not in _NEWER_KEYS) != sorted(_KEYS) or \
                not set(data) <= {*_KEYS, *_NEWER_KEYS}:
            raise IntentShapeError(f"an object with exactly the keys {', '.join(_KEYS)} "
                                   f"(and {', '.join(_NEWER_KEYS)})")
        if type(data["format"]) is not int or data["format"] != STATE_FORMAT:  # not 1.0, not true
            raise IntentShapeError(f"format: {STATE_FORMAT} expected, got {data['format']!r}")
        released = tag_list(data, "released")
        unrestored = tag_list(data, "unrestored")
        if not set(unrestored) <= set(released):
            raise IntentShapeError("unrestored: tags not released")
        stale = data["stale"]
        if stale is not None and (not isinstance(stale, dict) or sorted(stale) != ["had", "served"]):
            raise IntentShapeError("stale: null or an object with the keys served and had")
        if not isinstance(data["weights_updated"], bool):
            raise IntentShapeError("weights_updated: a boolean expected")
        if data["stage_to_cpu"] is not None and not isinstance(data["stage_to_cpu"], bool):
            raise IntentShapeError("stage_to_cpu: null or a boolean expected")
        if type(data.get("paused", False)) is not bool:
            raise IntentShapeError("paused: a boolean expected")
        joined, lost = _groups(data, "joined_groups"), _groups(data, "lost_groups")
        if joined & lost:
            raise IntentShapeError("joined_groups and lost_groups: a group in both")
        return cls(released=set(released), weights_updated=data["weights_updated"],
                   engine=text_field(data["engine"], "engine", MAX_ENGINE_CHARS), unrestored=unrestored,
                   stale=None if stale is None else StaleWeights(text_field(stale["served"], "stale.served"),
                                                                text_field(stale["had"], "stale.had")),
                   stage_to_cpu=data["stage_to_cpu"], joined_groups=joined, lost_groups=lost,
                   weight_version=text_field(data["weight_version"], "weight_version"),
                   engine_memory=TagRecord.from_json(data.get("engine_memory")), paused=data.get("paused", False),
                   on_change=on_change)

    @_recorded
    def record_release(self, tags: list[str], *, stage_to_cpu: bool | None = None) -> None:
        """``tags`` are released now, as the cluster asked; ``stage_to_cpu`` as it asked, kept for a release again
        when the call released a tag not released before (a repeated release changes nothing)."""
        self._release(tags, stage_to_cpu)

    def _release(self, tags: list[str], stage_to_cpu: bool | None) -> None:
        if not self.released.issuperset(tags):
            self.stage_to_cpu = stage_to_cpu
        self.released.update(tags)
        self.unrestored = [t for t in self.unrestored if t not in tags]

    @_recorded
    def record_resume(self, tags: list[str]) -> None:
        """``tags`` are resident now, as the cluster asked (one never released again on a fresh engine may stay)."""
        self._resume(tags)

    def _resume(self, tags: list[str]) -> None:
        self.released.difference_update(tags)
        self.unrestored = [t for t in self.unrestored if t not in tags]

    @_recorded
    def record_weights_loaded(self, version: str | None = None, *, resumed: list[str] | None = None,
                              updated_fully: bool = True) -> None:
        """A weight update or a reload succeeded: the engine serves the weights the cluster sent (``version``);
        ``resumed``: the released tags it woke to load them, resident now as after a resume. ``updated_fully``
        false: the engine said that updates have not yet written every weight since it started (a bucket), so a
        fresh engine's start weights are still partly served and :attr:`stale` stays."""
        self.weights_updated = True
        self.weight_version = version
        if updated_fully:
            self.stale = None
        self._resume(resumed or [])

    @_recorded
    def record_engine_memory(self, memory: TagRecord) -> None:
        """The adapter's record of its engine process's tags is ``memory`` now."""
        self.engine_memory = memory

    @_recorded
    def record_paused(self, paused: bool) -> None:
        """Generation is paused by the sidecar itself now (``paused``), or continued."""
        self.paused = paused

    @_recorded
    def record_joined(self, group: str) -> None:
        """The engine joined weight group ``group``."""
        self.joined_groups.add(group)
        self.lost_groups.discard(group)

    @_recorded
    def record_left(self, group: str) -> None:
        """The node is in weight group ``group`` no more (destroyed, or lost with an engine and so acknowledged)."""
        self.joined_groups.discard(group)
        self.lost_groups.discard(group)

    @_recorded
    def meet_engine(self, instance: str | None, *, served_version: str | None, had_version: str | None,
                    released: Collection[str] = (), updated: bool = False, resident: Collection[str] = ()) -> bool:
        """Note the engine process read now, which holds ``released`` released and, if ``updated``, serves weights
        an update wrote since it started; True if it is a fresh one replacing the process this held for (then
        :attr:`unrestored` and :attr:`stale` say what the node must do before it serves). An engine that names no
        process, and the first one seen, are taken as they are, and what the cluster did to such a process
        (through this sidecar or one before it, whose record of it may be lost or was never written) is learnt
        from it, never forgotten: its released tags, and that its weights came from an update (``served_version``
        then the version the node had), kept for a fresh engine too. ``resident``: the tags such a process itself
        says it holds resident (only an engine that reports its own tags): a release of one of them was undone
        since (a resume the engine ran after the sidecar gave up on it), so it is forgotten, unless a fresh engine
        still owes it (:attr:`unrestored`)."""
        if instance is None or instance == self.engine or self.engine is None:
            self.engine = self.engine if instance is None else instance
            self.released.update(released)
            self.released.difference_update(t for t in resident if t not in self.unrestored)
            if updated and not self.weights_updated:
                self.weights_updated, self.weight_version = True, served_version
            return False
        self.engine = instance
        self.unrestored = [t for t in TAGS if t in self.released]
        self.lost_groups |= self.joined_groups
        self.joined_groups = set()
        if self.weights_updated or self.stale is not None:
            had = self.stale.had if self.stale is not None else (
                had_version if had_version is not None else self.weight_version)  # the latter: a restarted sidecar
            self.stale = StaleWeights(served_version, had)
        self.weights_updated = updated  # updated before this sidecar read it: not by the cluster's latest, maybe
        return True

    @_recorded
    def restored(self, tags: list[str]) -> None:
        """The fresh engine released ``tags`` again (the unrestored ones and any freed together with them)."""
        self._release(tags, self.stage_to_cpu)  # one change: on_change never hears the intent half restored
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


def _groups(data: dict[str, Any], name: str) -> set[str]:
    groups = data[name]
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS or len(set(groups)) != len(groups) or \
            not all(isinstance(g, str) and 0 < len(g) <= MAX_NAME_CHARS for g in groups):
        raise IntentShapeError(f"{name}: at most {MAX_GROUPS} distinct group names of 1 to {MAX_NAME_CHARS} "
                               "characters expected")
    return set(groups)

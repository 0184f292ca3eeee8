"""Per-tag memory state of the engine: release, resume, and what they report.

Rules (SPEC section 2):
- Release and resume are idempotent per tag: a tag already in the asked
  state is reported (``already_released`` / ``already_resident``) and not
  touched.
- A release first asks the saver whether every tag can go (the room for a
  weights backup); if not it raises that ``OSError`` and changes nothing.
- A resume first checks that the device has the bytes it needs plus a
  margin, and, when the resume makes the engine serve again, the activations
  of its largest step (``step_headroom_bytes``: the first step after a resume
  must not run out of memory); if not it raises :class:`NotEnoughMemory` and
  changes nothing.
- Weights resumed without a kept copy are invalid until a reload succeeds;
  the engine refuses generation until then.
- A ``WeightsListener`` (the runner's weight packing) hears just before the
  weights are released and just after they are resumed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Iterable, Protocol, Sequence

from node_engine.memory.info import DeviceMemory, MemoryInfo
from node_engine.memory.saver import MemorySaver, MemorySaverDisabled
from node_engine.memory.tags import ALL_TAGS, BackupMode, MemoryTag, TagState
from node_engine.weight_coverage import WeightCoverage

log = logging.getLogger(__name__)

MIN_RESUME_MARGIN_BYTES = 16 * 1024 * 1024


class WeightsListener(Protocol):
    """Hears about the weights tag; ``after_resume`` must not raise (it runs inside a resume)."""

    def before_release(self, *, keep_contents: bool) -> None: ...

    def after_resume(self, *, is_valid: bool) -> None: ...


class NotEnoughMemory(RuntimeError):
    def __init__(self, needed_bytes: int, free_bytes: int, step_headroom_bytes: int = 0) -> None:
        super().__init__(f"resume needs {needed_bytes} bytes (margin and {step_headroom_bytes} bytes of step "
                         f"activations included), the device has {free_bytes} free")
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.step_headroom_bytes = step_headroom_bytes


class NoWeightsBackup(RuntimeError):
    pass


class BackupUnreadable(OSError):
    """The weights backup could not be read back: the weights stay released and the backup is kept."""


@dataclass
class ReleaseResult:
    released: list[str]
    already_released: list[str]
    bytes_freed: dict[str, int]
    duration_s: float


@dataclass
class ResumeResult:
    resumed: list[str]
    already_resident: list[str]
    bytes_restored: dict[str, int]
    weights_valid: bool
    duration_s: float


@dataclass
class MemoryState:
    states: dict[MemoryTag, TagState] = field(default_factory=lambda: {t: TagState.RESIDENT for t in ALL_TAGS})
    weights_valid: bool = True


class MemoryManager:
    def __init__(self, saver: MemorySaver, info: MemoryInfo, weights_backup: BackupMode,
                 weights_listener: WeightsListener | None = None, *, step_headroom_bytes: int = 0) -> None:
        self.saver = saver
        self.info = info
        self.step_headroom_bytes = step_headroom_bytes
        self.weights_backup = weights_backup
        self.weights_listener = weights_listener
        self.state = MemoryState()
        self._weights_kept = False
        self._written_since_invalid = WeightCoverage()

    @property
    def weights_valid(self) -> bool:
        return self.state.weights_valid

    def mark_weights_valid(self) -> None:
        self.state.weights_valid = True
        self._written_since_invalid.restart()

    def mark_weights_invalid(self) -> None:
        self.state.weights_valid = False
        self._written_since_invalid.restart()

    def note_weights_written(self, keys: Iterable[str], all_keys: Collection[str]) -> None:
        """Some weights were written (a bucket): invalid weights become valid once every key was written since."""
        if self.state.weights_valid:
            return
        self._written_since_invalid.note(keys, all_keys)
        if self._written_since_invalid.is_full:
            self.mark_weights_valid()

    def released_tags(self) -> list[MemoryTag]:
        return [t for t in ALL_TAGS if self.state.states[t] is TagState.RELEASED]

    @property
    def is_all_resident(self) -> bool:
        return not self.released_tags()

    def release(self, tags: Sequence[MemoryTag] | None, *, stage_to_cpu: bool | None) -> ReleaseResult:
        """Release ``tags`` (None: all; empty: none). ``stage_to_cpu``: None uses the configured backup."""
        wanted = list(ALL_TAGS) if tags is None else list(tags)
        if not wanted:
            return ReleaseResult([], [], {}, 0.0)
        if not self.saver.is_enabled:  # before the listener hears anything
            raise MemorySaverDisabled("memory saver is off: start the engine with --enable-memory-saver")
        has_backup = self.weights_backup is not BackupMode.NONE
        if stage_to_cpu and not has_backup:
            raise NoWeightsBackup("stage_to_cpu needs a weights backup: start the engine with "
                                  "--weights-backup cpu or disk")
        keep_weights = has_backup if stage_to_cpu is None else stage_to_cpu
        start = time.perf_counter()
        for tag in wanted:  # every check before the first release
            if self.state.states[tag] is TagState.RESIDENT:
                self.saver.check_release(tag, keep_contents=tag is MemoryTag.WEIGHTS and keep_weights)
        released, already, freed = [], [], {}
        for tag in wanted:
            if self.state.states[tag] is TagState.RELEASED:
                already.append(tag.value)
                continue
            is_weights = tag is MemoryTag.WEIGHTS
            if is_weights and self.weights_listener is not None:
                self.weights_listener.before_release(keep_contents=keep_weights)
            try:
                freed[tag.value] = self.saver.release(tag, keep_contents=is_weights and keep_weights)
            except BaseException:
                if is_weights and self.weights_listener is not None:  # still resident: as after a resume
                    self.weights_listener.after_resume(is_valid=self.state.weights_valid)
                raise
            if is_weights:
                self._weights_kept = keep_weights  # invalid weights come back as invalid, their writes counted
            self.state.states[tag] = TagState.RELEASED
            released.append(tag.value)
        return ReleaseResult(released, already, freed, time.perf_counter() - start)

    def bytes_to_resume(self, tags: Sequence[MemoryTag]) -> int:
        return sum(self.saver.tag_bytes(t) for t in tags if self.state.states[t] is TagState.RELEASED)

    def check_fits(self, tags: Sequence[MemoryTag]) -> DeviceMemory:
        device = self.info.read()
        needed = self.bytes_to_resume(tags)
        if needed == 0:
            return device
        serves_after = all(t in tags or s is TagState.RESIDENT for t, s in self.state.states.items())
        headroom = self.step_headroom_bytes if serves_after else 0
        with_margin = needed + max(MIN_RESUME_MARGIN_BYTES, needed // 20) + headroom
        if device.free_bytes < with_margin:
            raise NotEnoughMemory(with_margin, device.free_bytes, headroom)
        return device

    def resume(self, tags: Sequence[MemoryTag] | None, *, backup_optional: bool = False) -> ResumeResult:
        """Resume ``tags`` (None: all, the resident ones reported as already resident; empty: none), after
        checking the memory fits. A weights backup that cannot be read back is :class:`BackupUnreadable` (the
        weights stay released, the backup kept), unless ``backup_optional`` (an update about to write the
        weights): then they resume without it, invalid until every weight is written."""
        start = time.perf_counter()
        wanted = list(ALL_TAGS) if tags is None else list(tags)
        self.check_fits(wanted)
        resumed, already, restored = [], [], {}
        for tag in wanted:
            if self.state.states[tag] is TagState.RESIDENT:
                already.append(tag.value)
                continue
            restored[tag.value] = self._resume_tag(tag, backup_optional=backup_optional)
            self.state.states[tag] = TagState.RESIDENT
            resumed.append(tag.value)
            if tag is MemoryTag.WEIGHTS:
                if not self._weights_kept:
                    self.mark_weights_invalid()
                if self.weights_listener is not None:
                    self.weights_listener.after_resume(is_valid=self.state.weights_valid)
        return ResumeResult(resumed, already, restored, self.state.weights_valid, time.perf_counter() - start)

    def _resume_tag(self, tag: MemoryTag, *, backup_optional: bool) -> int:
        try:
            return self.saver.resume(tag)
        except OSError as exc:
            if not (tag is MemoryTag.WEIGHTS and self._weights_kept):
                raise
            if not backup_optional:
                raise BackupUnreadable(str(exc)) from exc
            log.warning("the weights backup cannot be read back (%s): resumed without it, for an update to write",
                        exc)
            self.saver.discard_backup(tag)
            self._weights_kept = False
            return self.saver.resume(tag)

    def occupation(self) -> dict[str, dict[str, object]]:
        return {t.value: {"state": self.state.states[t].value, "bytes": self.saver.tag_bytes(t)} for t in ALL_TAGS}

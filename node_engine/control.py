"""The engine's control commands: release, resume, flush, and the memory view (weight changes:
:mod:`node_engine.weight_updates`).

Each command (except the view) runs on the engine thread, through
:meth:`Engine.call`, between two steps: nothing else touches the tensors
meanwhile. Release and weight updates refuse while a request is queued or
running (409 ``requests_in_flight``): the sidecar drains first, and nobody can
corrupt a running request through the engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import psutil
import torch

from handoff.protocol.control import ENGINE_INSTANCE, FLUSHED
from handoff.protocol.weights import WEIGHTS_UPDATED
from node_engine.errors import (BackupFailed, InsufficientMemory, MemorySaverDisabledError, NoWeightsBackupError,
                                RequestsInFlight)
from node_engine.failures import is_out_of_memory
from node_engine.memory.manager import BackupUnreadable, NotEnoughMemory, NoWeightsBackup
from node_engine.memory.saver import MemorySaverDisabled
from node_engine.memory.tags import MemoryTag

if TYPE_CHECKING:
    from node_engine.engine import Engine

log = logging.getLogger(__name__)


class EngineControl:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.is_paused = False  # pause_generation (retract, in_place): requests stay, nothing steps

    def require_idle(self, what: str, *, paused_ok: bool = False) -> None:
        """Refuse (409) while requests run or wait; ``paused_ok``: requests paused by ``pause_generation``
        do not count (a weight update under a pause is what SGLang's pause modes are for)."""
        if paused_ok and self.is_paused:
            return
        num = self.engine.scheduler.num_requests
        if num:
            raise RequestsInFlight(f"{num} request(s) running or queued; {what} needs an idle engine "
                                   "(the sidecar drains first)", extra={"in_flight": num})

    def _require_no_kv_in_use(self, what: str) -> None:
        """A release may go on under a retract pause (waiting requests hold no KV), never under requests that do."""
        scheduler = self.engine.scheduler
        if self.is_paused and not scheduler.running:
            return
        self.require_idle(what)

    # -- pause (SGLang's retract and in_place modes) --------------------------------
    def pause(self, mode: str) -> dict[str, Any]:
        """``retract``: running requests go back to the queue, their KV freed (recomputed after continue),
        behind the requests already waiting, in their order, as SGLang appends them; ``in_place``: they keep
        their KV. Either way nothing steps until :meth:`continue_generation`; new requests queue."""
        scheduler = self.engine.scheduler
        retracted = 0
        if mode == "retract":
            for request in list(scheduler.running):
                scheduler.preempt(request, to_back=True)
                retracted += 1
        self.is_paused = True
        log.info("generation paused (%s): %d retracted, %d request(s) kept", mode, retracted,
                 scheduler.num_requests)
        return {"success": True, "paused": True, "mode": mode, "retracted_requests": retracted,
                "paused_requests": scheduler.num_requests}

    def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, Any]:
        if torch_empty_cache and self.engine.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.is_paused = False
        return {"success": True, "paused": False}

    def release(self, tags: Sequence[MemoryTag] | None, stage_to_cpu: bool | None) -> dict[str, Any]:
        """Release ``tags`` (None: all; empty: nothing, answered at once)."""
        engine = self.engine
        if tags is not None and not tags:
            return {"success": True, "released": [], "already_released": [], "bytes_freed": {}, "duration_s": 0.0}
        self._require_no_kv_in_use("a release")
        if engine.drill is not None:
            engine.drill.fire("release")
        try:
            result = engine.memory.release(tags, stage_to_cpu=stage_to_cpu)
        except MemorySaverDisabled as exc:
            raise MemorySaverDisabledError(str(exc)) from exc
        except NoWeightsBackup as exc:
            raise NoWeightsBackupError(str(exc)) from exc
        except OSError as exc:  # only the weights backup does I/O
            released = [t.value for t in engine.memory.released_tags()]
            raise BackupFailed(f"could not write the weights backup ({exc}); the weights stay resident",
                               extra={"released": released}) from exc
        engine.metrics.release_seconds.observe(result.duration_s)
        log.info("released %s (%d bytes) in %.3fs; already released: %s", result.released,
                 sum(result.bytes_freed.values()), result.duration_s, result.already_released)
        return {"success": True, "released": result.released, "already_released": result.already_released,
                "bytes_freed": result.bytes_freed, "duration_s": round(result.duration_s, 6)}

    def resume(self, tags: Sequence[MemoryTag] | None, *, backup_optional: bool = False) -> dict[str, Any]:
        """Resume ``tags`` (None: all, resident ones reported in ``already_resident``; empty: nothing)."""
        engine = self.engine
        if not engine.saver.is_enabled and (tags is None or tags):
            raise MemorySaverDisabledError("memory saver is off: start the engine with --enable-memory-saver")
        if engine.drill is not None:
            engine.drill.fire("resume")
        started = time.perf_counter()
        released_before = set(engine.memory.released_tags())
        try:
            result = engine.memory.resume(tags, backup_optional=backup_optional)
        except BackupUnreadable as exc:
            raise BackupFailed(f"could not read the weights backup back ({exc}); the weights stay released and the "
                               "backup is kept: resume again, or reload or push the weights (which resume without "
                               "it)", extra={"released": [t.value for t in engine.memory.released_tags()]}) from exc
        except NotEnoughMemory as exc:
            raise InsufficientMemory(str(exc), extra={"needed_bytes": exc.needed_bytes, "free_bytes": exc.free_bytes,
                                                      "step_headroom_bytes": exc.step_headroom_bytes}) from exc
        except (MemoryError, RuntimeError) as exc:  # the room was checked, and the allocator refused all the same
            if not is_out_of_memory(exc):
                raise
            still = [t.value for t in engine.memory.released_tags()]
            raise InsufficientMemory(f"the memory to resume could not be had ({str(exc)[:300]}); still released: "
                                     f"{', '.join(still) or 'nothing'}: resume again once memory is free",
                                     extra={"released": still}) from exc
        finally:
            # Also when it failed part way: the tags it brought back before that lost their contents all the same.
            self._forget_contents(released_before - set(engine.memory.released_tags()))
        duration = time.perf_counter() - started
        engine.metrics.resume_seconds.observe(duration)
        log.info("resumed %s in %.3fs; weights_valid=%s", result.resumed, duration, result.weights_valid)
        return {"success": True, "resumed": result.resumed, "already_resident": result.already_resident,
                "bytes_restored": result.bytes_restored, "weights_valid": result.weights_valid,
                "duration_s": round(duration, 6)}

    def _forget_contents(self, resumed: set[MemoryTag]) -> None:
        """Resumed tags hold zeros (or undefined pages), whatever they held before their release."""
        engine = self.engine
        if MemoryTag.KV_CACHE in resumed:
            # The KV contents are gone: every slot is free again and no cached prefix survives.
            engine.scheduler.slots.reset()
            engine.scheduler.rows.reset()
            if engine.scheduler.cache is not None:
                engine.scheduler.cache.reset()
            engine.runner.reset_kv_cache()
        if MemoryTag.WORKSPACE in resumed:
            engine.runner.reset_workspace()

    def flush_cache(self) -> dict[str, Any]:
        """``message`` begins as SGLang's plain-text answer does: scripts written for SGLang look for it."""
        return {"success": True, "message": FLUSHED, "num_cached_tokens_dropped": self.flush()}

    def flush(self) -> int:
        """Drop every cached prefix (in-use ones are freed when their requests end); returns tokens dropped."""
        cache = self.engine.scheduler.cache
        return cache.flush() if cache is not None else 0

    def occupation(self) -> dict[str, Any]:
        engine = self.engine
        device = engine.memory.info.read()
        return {
            "tags": engine.memory.occupation(),
            "weights_valid": engine.memory.weights_valid,
            "weight_version": engine.weight_version,
            "memory_saver": engine.saver.name,
            "weights_backup": engine.config.weights_backup.value,
            "device": {"type": device.device_type, "free_bytes": device.free_bytes,
                       "total_bytes": device.total_bytes},
            "outside_tags": engine.runner.memory_outside_tags(),
            "process_rss_bytes": psutil.Process().memory_info().rss,
            "paused": self.is_paused,
            "control_calls_pending": engine.num_calls_pending,
            "running_requests": len(engine.scheduler.running),
            "queued_requests": len(engine.scheduler.waiting),
            ENGINE_INSTANCE: engine.instance,
            WEIGHTS_UPDATED: engine.weights.written.any_written,
        }

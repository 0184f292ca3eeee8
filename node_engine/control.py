"""The engine's control commands: release, resume, reload, flush, and the memory view.

Each command (except :meth:`EngineControl.check_weights` and the view) runs on
the engine thread, through :meth:`Engine.call`, between two steps: nothing else
touches the tensors meanwhile. Release and reload refuse while a request is
queued or running (409 ``requests_in_flight``): the sidecar drains first, and
nobody can corrupt a running request through the engine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import psutil

from node_engine.errors import (BackupFailed, InsufficientMemory, InvalidRequest, MemorySaverDisabledError,
                                NoWeightsBackupError, RequestsInFlight, WeightsCorrupted, WeightsReleased)
from node_engine.memory.manager import NotEnoughMemory, NoWeightsBackup
from node_engine.memory.saver import MemorySaverDisabled
from node_engine.memory.tags import MemoryTag
from node_engine.model.arch import ModelConfigError

if TYPE_CHECKING:
    from node_engine.engine import Engine

log = logging.getLogger(__name__)


class EngineControl:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def _require_idle(self, what: str) -> None:
        num = self.engine.scheduler.num_requests
        if num:
            raise RequestsInFlight(f"{num} request(s) running or queued; {what} needs an idle engine "
                                   "(the sidecar drains first)", extra={"in_flight": num})

    def release(self, tags: Sequence[MemoryTag] | None, stage_to_cpu: bool | None) -> dict[str, Any]:
        """Release ``tags`` (None: all; empty: nothing, answered at once)."""
        engine = self.engine
        if tags is not None and not tags:
            return {"success": True, "released": [], "already_released": [], "bytes_freed": {}, "duration_s": 0.0}
        self._require_idle("a release")
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

    def resume(self, tags: Sequence[MemoryTag] | None) -> dict[str, Any]:
        """Resume ``tags`` (None: all, resident ones reported in ``already_resident``; empty: nothing)."""
        engine = self.engine
        if not engine.saver.is_enabled and (tags is None or tags):
            raise MemorySaverDisabledError("memory saver is off: start the engine with --enable-memory-saver")
        if engine.drill is not None:
            engine.drill.fire("resume")
        started = time.perf_counter()
        try:
            result = engine.memory.resume(tags)
        except NotEnoughMemory as exc:
            raise InsufficientMemory(str(exc), extra={"needed_bytes": exc.needed_bytes, "free_bytes": exc.free_bytes,
                                                      "step_headroom_bytes": exc.step_headroom_bytes}) from exc
        resumed = set(result.resumed)
        if MemoryTag.KV_CACHE.value in resumed:
            # The KV contents are gone: every slot is free again and no cached prefix survives.
            engine.scheduler.slots.reset()
            engine.scheduler.rows.reset()
            if engine.scheduler.cache is not None:
                engine.scheduler.cache.reset()
            engine.runner.reset_kv_cache()
        if MemoryTag.WORKSPACE.value in resumed:
            engine.runner.reset_workspace()
        duration = time.perf_counter() - started
        engine.metrics.resume_seconds.observe(duration)
        log.info("resumed %s in %.3fs; weights_valid=%s", result.resumed, duration, result.weights_valid)
        return {"success": True, "resumed": result.resumed, "already_resident": result.already_resident,
                "bytes_restored": result.bytes_restored, "weights_valid": result.weights_valid,
                "duration_s": round(duration, 6)}

    def check_weights(self, model_path: str) -> dict[str, Any]:
        """Validate a checkpoint against the running model (files, keys, shapes, dtypes); changes nothing.

        Reads only the checkpoint's headers and the parameters' shapes, so it may
        run on any thread while the engine serves.
        """
        try:
            self.engine.runner.check_weights_update(Path(model_path))
        except ModelConfigError as exc:
            raise InvalidRequest(f"cannot load {model_path}: {exc}") from exc
        return {"success": True, "dry_run": True, "message": f"{model_path} can be loaded"}

    def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> dict[str, Any]:
        engine = self.engine
        self._require_idle("a weight reload")
        if MemoryTag.WEIGHTS in engine.memory.released_tags():
            raise WeightsReleased("the weights are released; resume them first, then reload")
        started = time.perf_counter()
        try:
            entries = engine.runner.check_weights_update(Path(model_path))
        except ModelConfigError as exc:
            raise InvalidRequest(f"cannot load {model_path}: {exc}") from exc
        try:
            engine.runner.apply_weights_update(entries)
        except Exception as exc:
            engine.memory.mark_weights_invalid()
            raise WeightsCorrupted(f"reload of {model_path} failed part way ({exc}); generation is refused until "
                                   "a reload succeeds") from exc
        engine.memory.mark_weights_valid()
        engine.weight_version = weight_version or model_path
        self._flush()
        duration = time.perf_counter() - started
        log.info("weights reloaded from %s in %.2fs, weight_version=%s", model_path, duration, engine.weight_version)
        return {"success": True, "message": f"weights loaded from {model_path}",
                "weight_version": engine.weight_version, "duration_s": round(duration, 6)}

    def flush_cache(self) -> dict[str, Any]:
        return {"success": True, "num_cached_tokens_dropped": self._flush()}

    def _flush(self) -> int:
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
            "running_requests": len(engine.scheduler.running),
            "queued_requests": len(engine.scheduler.waiting),
        }

"""Control calls: release, resume, reload, pause, continue, flush (SPEC section 3).

Each runs under the node's control lock, so calls run one at a time in
arrival order and a repeated call finds the work done (idempotent per tag).
Release: validate → report already-released tags → close admission → drain
(wait) or abort → engine release → answer. A failure at any step leaves
nothing half done: admission reopens if the node can serve, tags go back to
where they were, and the engine's own view is re-read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from handoff.protocol import errors as E
from handoff.service.errors import Conflict
from node_sidecar.errors import DrainTimeout, EngineRefused, EngineUnavailable
from node_sidecar.node import Node
from node_sidecar.state import TAGS, TagState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainLimit:
    """How long a drain may wait: the asked (or default) seconds, cut short so that the caller, who stops waiting
    at ``answer_by`` (event-loop time, its margin taken), still gets the answer (409 ``drain_timeout``)."""

    seconds: float
    answer_by: float | None = None

    def remaining(self) -> float:
        if self.answer_by is None:
            return self.seconds
        return max(0.0, min(self.seconds, self.answer_by - asyncio.get_running_loop().time()))


class ControlPlane:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.metrics = node.metrics

    @contextlib.asynccontextmanager
    async def _draining(self) -> AsyncIterator[None]:
        """Admission stays closed for the block; afterwards it follows the node's state again."""
        node = self.node
        node.is_draining = True
        node.refresh_admission()
        try:
            yield
        finally:
            node.is_draining = False
            node.refresh_admission()

    async def _drain(self, mode: str, limit: DrainLimit) -> tuple[int, int]:
        """Empty the node of generation; returns (drained, aborted). Raises DrainTimeout."""
        timeout = limit.remaining()
        admission = self.node.admission
        num_in_flight = admission.num_in_flight
        if mode == "abort" and num_in_flight:
            await self.node.engine.call("POST", "/abort_request", {"abort_all": True})
        if not await admission.drain(timeout):
            raise DrainTimeout(f"{admission.num_in_flight} generation request(s) still running after "
                               f"{timeout:g}s; nothing was released", extra={"in_flight": admission.num_in_flight})
        if mode == "abort":
            self.metrics.aborted_requests.inc(num_in_flight)
            return 0, num_in_flight
        self.metrics.drained_requests.inc(num_in_flight)
        return num_in_flight, 0

    async def release(self, tags: list[str] | None, *, mode: str, drain: DrainLimit,
                      stage_to_cpu: bool | None) -> dict[str, Any]:
        """Release ``tags`` (None: all four; ``[]``: nothing, answered at once)."""
        node, state = self.node, self.node.state
        started = time.perf_counter()
        if tags is not None and not tags:
            return _release_answer([], [], {}, 0, 0, started)
        tags = list(TAGS) if tags is None else tags
        async with node.control_lock:
            node.require_engine()
            already = [t for t in tags if state.tags[t] is TagState.RELEASED]
            todo = [t for t in tags if state.tags[t] is TagState.RESIDENT]
            if not todo:
                return _release_answer([], already, {}, 0, 0, started)
            if state.memory_saver == "off":
                raise Conflict("memory saver is off: start the engine with --enable-memory-saver",
                               kind=E.MEMORY_SAVER_DISABLED)
            if stage_to_cpu and state.weights_backup == "none":
                raise Conflict("stage_to_cpu needs a weights backup: start the engine with --weights-backup "
                               "cpu or disk", kind=E.NO_WEIGHTS_BACKUP)
            async with self._draining():
                drained, aborted = await self._drain(mode, drain)
                drain_done = time.perf_counter()
                for tag in todo:
                    state.transition(tag, TagState.RELEASING)
                node.update_memory_metrics()
                body: dict[str, Any] = {"tags": todo}
                if stage_to_cpu is not None:
                    body["stage_to_cpu"] = stage_to_cpu
                try:
                    answer = await node.engine.call("POST", "/release_memory_occupation", body)
                except (EngineRefused, EngineUnavailable):
                    for tag in todo:
                        state.transition(tag, TagState.RESIDENT)
                    await node.resync_quietly()
                    raise
                for tag in todo:
                    state.transition(tag, TagState.RELEASED)
                node.update_memory_metrics()
        duration = time.perf_counter() - started
        self.metrics.release_seconds.observe(duration)
        log.info("released %s (drained %d, aborted %d) in %.3fs, engine %.3fs", todo, drained, aborted, duration,
                 time.perf_counter() - drain_done)
        return _release_answer(answer.get("released", todo), already + answer.get("already_released", []),
                               answer.get("bytes_freed", {}), drained, aborted, started)

    async def resume(self, tags: list[str] | None) -> dict[str, Any]:
        """Resume ``tags`` (None: all four, the resident ones reported in ``already_resident``; ``[]``: none)."""
        node, state = self.node, self.node.state
        started = time.perf_counter()
        wanted = list(TAGS) if tags is None else tags
        if not wanted:
            return {"success": True, "resumed": [], "already_resident": [], "bytes_restored": {},
                    "weights_valid": state.weights_valid, "serving": state.is_serving, "duration_s": 0.0}
        async with node.control_lock:
            node.require_engine()
            already = [t for t in wanted if state.tags[t] is TagState.RESIDENT]
            todo = [t for t in wanted if state.tags[t] is TagState.RELEASED]
            answer: dict[str, Any] = {}
            if todo:
                for tag in todo:
                    state.transition(tag, TagState.RESUMING)
                node.update_memory_metrics()
                try:
                    answer = await node.engine.call("POST", "/resume_memory_occupation", {"tags": todo})
                except (EngineRefused, EngineUnavailable):
                    for tag in todo:
                        state.transition(tag, TagState.RELEASED)
                    await node.resync_quietly()
                    raise
                for tag in todo:
                    state.transition(tag, TagState.RESIDENT)
                state.weights_valid = bool(answer.get("weights_valid", state.weights_valid))
                node.update_memory_metrics()
            node.refresh_admission()
        duration = time.perf_counter() - started
        self.metrics.resume_seconds.observe(duration)
        log.info("resumed %s in %.3fs; weights_valid=%s, serving=%s", todo, duration, state.weights_valid,
                 state.is_serving)
        return {"success": True, "resumed": todo, "already_resident": already,
                "bytes_restored": answer.get("bytes_restored", {}), "weights_valid": state.weights_valid,
                "serving": state.is_serving, "duration_s": round(duration, 6)}

    async def update_weights(self, body: dict[str, Any], *, drain: DrainLimit) -> dict[str, Any]:
        """Reload weights from disk, after draining generation like a release in wait mode.

        The checkpoint is checked first (the engine's dry run), so a wrong path or
        shape is a 400 while the node keeps serving, not after a drain.
        """
        node, state = self.node, self.node.state
        async with node.control_lock:
            node.require_engine()
            await node.engine.call("POST", "/update_weights_from_disk", {**body, "dry_run": True})
            async with self._draining():
                drained, _ = await self._drain("wait", drain)
                try:
                    answer = await node.engine.call("POST", "/update_weights_from_disk", body)
                except (EngineRefused, EngineUnavailable):
                    await node.resync_quietly()
                    raise
                state.weights_valid = True
                state.weight_version = answer.get("weight_version", state.weight_version)
        log.info("weights reloaded, weight_version=%s (drained %d)", state.weight_version, drained)
        return {**answer, "drained_requests": drained, "serving": state.is_serving}

    async def pause(self, *, mode: str, drain: DrainLimit) -> dict[str, Any]:
        node = self.node
        async with node.control_lock:
            node.state.is_paused = True
            try:
                async with self._draining():
                    drained, aborted = await self._drain(mode, drain)
            except DrainTimeout:
                node.state.is_paused = False
                node.refresh_admission()
                raise
        return {"success": True, "paused": True, "drained_requests": drained, "aborted_requests": aborted}

    async def resume_generation(self) -> dict[str, Any]:
        node = self.node
        async with node.control_lock:
            node.state.is_paused = False
            node.refresh_admission()
        return {"success": True, "paused": False, "serving": node.state.is_serving}

    async def flush_cache(self) -> dict[str, Any]:
        node = self.node
        async with node.control_lock:
            node.require_engine()
            return await node.engine.call("POST", "/flush_cache")


def _release_answer(released: list[str], already: list[str], bytes_freed: dict[str, int], drained: int, aborted: int,
                    started: float) -> dict[str, Any]:
    return {"success": True, "released": released, "already_released": already, "bytes_freed": bytes_freed,
            "drained_requests": drained, "aborted_requests": aborted,
            "duration_s": round(time.perf_counter() - started, 6)}


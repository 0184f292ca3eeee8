"""Control calls: release, resume, weight updates, pause, continue, flush (SPEC section 3).

Each runs under the node's control lock, so calls run one at a time in
arrival order and a repeated call finds the work done (idempotent per tag).
Release: validate → report already-released tags → close admission → drain
(wait) or abort → engine release → answer. A failure at any step leaves
nothing half done: admission reopens if the node can serve, tags go back to
where they were, and the engine's own view is re-read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from handoff.protocol import errors as E
from handoff.protocol.control import peer_weight_version
from handoff.protocol.engines import EngineKind
from handoff.protocol.tags import Tag
from handoff.protocol.weights import WEIGHTS_UPDATED_FULLY
from handoff.service.errors import Conflict, ServiceError
from node_sidecar.engines.base import MemoryChange
from node_sidecar.control_drain import DrainLimit, Drainer
from node_sidecar.errors import LoadedNotFlushed
from node_sidecar.node import Node
from node_sidecar.state import TAGS, NodeState, TagState

WEIGHTS = Tag.WEIGHTS.value
ENGINE_PAUSE_MODES = frozenset({"retract", "in_place"})  # requests stay in the engine, paused there

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.metrics = node.metrics
        self._drainer = Drainer(node)

    @contextlib.asynccontextmanager
    async def _keeping_intent(self) -> AsyncIterator[None]:
        """The call answers once what it changed of the cluster's intent is in ``--state-file`` (or its write
        failed, or stalled past a bound: logged), waited for off the event loop and out of the control lock."""
        try:
            yield
        finally:
            await self.node.intent_written()

    @contextlib.asynccontextmanager
    async def _moving(self, tags: list[str], through: TagState, done: TagState,
                      undone: TagState) -> AsyncIterator[None]:
        """``tags`` are ``through`` for the block, then ``done``; if the block fails they go back to ``undone``
        and, for an engine failure, the engine's own view is read again."""
        node, state = self.node, self.node.state
        for tag in tags:
            state.transition(tag, through)
        try:
            yield
        except BaseException as exc:
            for tag in tags:
                state.transition(tag, undone)
            if isinstance(exc, ServiceError):
                await node.resync_quietly()
            raise
        for tag in tags:
            state.transition(tag, done)

    async def release(self, tags: list[str] | None, *, mode: str, drain: DrainLimit,
                      stage_to_cpu: bool | None) -> dict[str, Any]:
        """Release ``tags`` (None: all four; ``[]``: nothing, answered at once). An engine that frees some tags
        only together releases (and reports) the resident ones that go with those asked."""
        node, state = self.node, self.node.state
        started = time.perf_counter()
        if tags is not None and not tags:
            return _release_answer([], [], MemoryChange([], {}, None), 0, 0, started)
        tags = list(TAGS) if tags is None else tags
        async with self._keeping_intent(), node.control_lock:
            node.require_engine()
            _refuse_unknown(state, tags)
            adapter = node.engine_adapter
            already = [t for t in tags if state.tags[t] is TagState.RELEASED]
            asked = [t for t in tags if state.tags[t] is TagState.RESIDENT]
            if not asked:
                state.intent.record_release(already, stage_to_cpu=stage_to_cpu)
                return _release_answer([], already, MemoryChange([], {}, None), 0, 0, started)
            if state.memory_saver == "off":
                raise Conflict(_SAVER_OFF[adapter.kind], kind=E.MEMORY_SAVER_DISABLED)
            if stage_to_cpu and not state.can_stage_weights:
                raise Conflict(_NO_BACKUP[adapter.kind], kind=E.NO_WEIGHTS_BACKUP)
            todo = adapter.release_set(asked, state.tags_in(TagState.RESIDENT))
            with node.draining():
                # under a pause (SGLang's retract or in_place) paused requests stay: the engine releases around
                # retracted ones and refuses (409) while paused ones hold KV
                drained, aborted = (0, 0) if state.is_paused and mode == "wait" else \
                    await self._drainer.drain(mode, drain)
                drain_done = time.perf_counter()
                async with self._moving(todo, TagState.RELEASING, TagState.RELEASED, TagState.RESIDENT):
                    change = await adapter.release(todo, stage_to_cpu=stage_to_cpu)
                state.intent.record_release(todo + already, stage_to_cpu=stage_to_cpu)
                if change.weights_valid is not None:
                    state.weights_valid = change.weights_valid
        duration = time.perf_counter() - started
        self.metrics.release_seconds.observe(duration)
        log.info("released %s (drained %d, aborted %d) in %.3fs, engine %.3fs; %s (%s)", todo, drained, aborted,
                 duration, time.perf_counter() - drain_done, change.bytes, change.measured_by)
        return _release_answer(todo, already, change, drained, aborted, started)

    async def resume(self, tags: list[str] | None) -> dict[str, Any]:
        """Resume ``tags`` (None: all four, the resident ones reported in ``already_resident``; ``[]``: none)."""
        node, state = self.node, self.node.state
        started = time.perf_counter()
        wanted = list(TAGS) if tags is None else tags
        if not wanted:
            return {"success": True, "resumed": [], "already_resident": [], "bytes_restored": {},
                    "bytes_measured_by": None, "weights_valid": state.weights_valid, "serving": state.is_serving,
                    "duration_s": 0.0}
        async with self._keeping_intent(), node.control_lock:
            node.require_engine()
            _refuse_unknown(state, wanted)
            already = [t for t in wanted if state.tags[t] is TagState.RESIDENT]
            todo = [t for t in wanted if state.tags[t] is TagState.RELEASED]
            change = MemoryChange([], {}, None)
            if todo:
                async with self._moving(todo, TagState.RESUMING, TagState.RESIDENT, TagState.RELEASED):
                    change = await node.engine_adapter.resume(todo)
                if change.weights_valid is not None:
                    state.weights_valid = change.weights_valid
            state.intent.record_resume(todo + already)
            node.refresh_admission()
        duration = time.perf_counter() - started
        self.metrics.resume_seconds.observe(duration)
        log.info("resumed %s in %.3fs; weights_valid=%s, serving=%s", todo, duration, state.weights_valid,
                 state.is_serving)
        return {"success": True, "resumed": todo, "already_resident": already, "bytes_restored": change.bytes,
                "bytes_measured_by": change.measured_by, "weights_valid": state.weights_valid,
                "serving": state.is_serving, "duration_s": round(duration, 6)}

    async def check_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint check of a reload alone: nothing drains, nothing loads."""
        self.node.require_engine()
        return await self.node.engine_adapter.check_weights(body)

    async def update_weights(self, load: Callable[[], Awaitable[dict[str, Any]]], *, drain: DrainLimit,
                             mode: str = "wait", check: Callable[[], Awaitable[Any]] | None = None
                             ) -> dict[str, Any]:
        """A weight update (``load``: from disk, tensors or broadcasts, through the engine adapter), after
        draining generation; requests arriving meanwhile wait for it.

        ``check`` runs before anything drains (the checkpoint check of a reload), so a wrong path or shape is a 400
        while the node keeps serving. ``mode`` ``abort`` (the body's ``abort_all_requests``) ends generation first,
        paused requests included, as SGLang aborts before it looks at the pause. In ``wait`` mode nothing is drained
        while generation is paused (paused requests stay in the engine, as in SGLang) or while the node cannot step
        (weights invalid or released: its queued requests have not run, and only this update lets them). An engine
        that resumes released weights to load them says so in its answer's ``resumed`` (the others stay as they are).
        """
        node, state = self.node, self.node.state
        async with self._keeping_intent(), node.control_lock:
            node.require_engine()
            if check is not None:
                await check()
            with node.draining(updating_weights=True):
                can_step = state.weights_valid and state.is_all_resident
                drained, aborted = (0, 0) if mode == "wait" and (state.is_paused or not can_step) else \
                    await self._drainer.drain(mode, drain)
                try:
                    answer = await load()
                except ServiceError as exc:
                    if isinstance(exc, LoadedNotFlushed):  # a 409, but the weights are the update's all the same
                        self._loaded(exc.answer)
                    await node.resync_quietly()
                    raise
                self._loaded(answer)
        log.info("weights updated, weight_version=%s (drained %d, aborted %d)", state.weight_version, drained,
                 aborted)
        return {**answer, "drained_requests": drained, "aborted_requests": aborted, "serving": state.is_serving}

    def _loaded(self, answer: dict[str, Any]) -> None:
        """A weight update's ``answer`` taken in: weights woken, validity, version, the intent (``--state-file``)."""
        state = self.node.state
        woke = WEIGHTS in answer.get("resumed", ()) and state.tags[WEIGHTS] is TagState.RELEASED
        if woke:
            state.transition(WEIGHTS, TagState.RESUMING)
            state.transition(WEIGHTS, TagState.RESIDENT)
        valid = answer.get("weights_valid", True)
        state.weights_valid = valid if isinstance(valid, bool) else True
        if "weight_version" in answer:
            state.weight_version = peer_weight_version(answer["weight_version"])
        # an engine that does not say (vLLM, SGLang): any update is taken to replace every weight
        state.intent.record_weights_loaded(state.weight_version, resumed=[WEIGHTS] if woke else [],
                                           updated_fully=answer.get(WEIGHTS_UPDATED_FULLY) is not False)

    async def weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A weight call that changes only the engine's bookkeeping (the session, the version), one at a time with
        the other control calls; the version is adopted, and the weights' validity when the answer says it."""
        node = self.node
        async with node.control_lock:
            node.require_engine()
            answer = await node.engine_adapter.weight_call(path, body)
            if "new_version" in answer:
                node.state.weight_version = peer_weight_version(answer["new_version"])
            if isinstance(answer.get("weights_valid"), bool):
                node.state.weights_valid = answer["weights_valid"]
                node.refresh_admission()
        return answer

    async def pause(self, *, mode: str, drain: DrainLimit) -> dict[str, Any]:
        """Pause generation; new requests are held until :meth:`resume_generation` (as SGLang queues them).

        ``abort`` ends running requests, ``wait`` lets them finish (both drain here);
        ``retract`` and ``in_place`` leave them in the engine, paused there (their
        streams stay open and finish after the continue).
        """
        node = self.node
        async with self._keeping_intent(), node.control_lock:
            if mode in ENGINE_PAUSE_MODES:
                node.require_engine()
            was_paused = node.state.is_paused
            node.state.is_paused = True
            node.refresh_admission()
            try:
                if mode in ENGINE_PAUSE_MODES:
                    answer = await node.engine_adapter.pause(mode)
                    drained, aborted = 0, 0
                else:
                    answer = {}
                    with node.draining():
                        drained, aborted = await self._drainer.drain(mode, drain)
            except ServiceError:
                node.state.is_paused = was_paused
                node.refresh_admission()
                if mode in ENGINE_PAUSE_MODES:  # the engine may still pause (a call it answers late runs)
                    await node.resync_quietly()
                raise
            if mode in ENGINE_PAUSE_MODES:
                node.state.is_engine_paused = True  # read from the engine again after a restart of the sidecar
            else:
                node.state.intent.record_paused(True)  # the engine knows nothing of it: kept for a restart
        return {"success": True, "paused": True, "mode": mode, "drained_requests": drained,
                "aborted_requests": aborted, "retracted_requests": answer.get("retracted_requests", 0),
                "paused_requests": answer.get("paused_requests", 0), "message": "Generation paused successfully.",
                "status": "ok"}

    async def resume_generation(self, *, torch_empty_cache: bool = True) -> dict[str, Any]:
        """Continue: the engine's paused requests step again, held requests enter. A pause the engine holds
        (retract, in_place) needs the engine: unreachable, 503 and nothing changes (a 200 would leave the engine
        paused and the node holding requests again once it is back). A continue the adapter holds back is answered
        once it is in ``--state-file``."""
        node = self.node
        async with self._keeping_intent(), node.control_lock:
            if node.state.is_engine_reachable:
                await node.engine_adapter.continue_generation(torch_empty_cache=torch_empty_cache)
            elif node.state.is_engine_paused:
                node.require_engine()
            node.state.is_paused = node.state.is_engine_paused = False
            node.state.intent.record_paused(False)
            node.refresh_admission()
        return {"success": True, "paused": False, "serving": node.state.is_serving,
                "message": "Generation continued successfully.", "status": "ok"}

    async def flush_cache(self, limit: DrainLimit) -> dict[str, Any]:
        """Drop the engine's prefix cache within ``limit`` as its adapter does; read the engine again if it failed
        (an adapter that paused the engine for it may have left it paused)."""
        node = self.node
        async with node.control_lock:
            node.require_engine()
            try:
                return await node.engine_adapter.flush_cache(limit.remaining())
            except ServiceError:
                await node.resync_quietly()
                raise


# What to start differently, per engine kind, when a release cannot be done.
_SAVER_OFF = {
    EngineKind.HANDOFF: "memory saver is off: start the engine with --enable-memory-saver",
    EngineKind.VLLM: "vLLM's sleep mode is off: start vLLM with --enable-sleep-mode (GPU) and VLLM_SERVER_DEV_MODE=1",
    EngineKind.SGLANG: "SGLang's memory saver is off: start SGLang with --enable-memory-saver",
}
_NO_BACKUP = {
    EngineKind.HANDOFF: "stage_to_cpu needs a weights backup: start the engine with --weights-backup cpu or disk",
    EngineKind.VLLM: "stage_to_cpu needs a weights backup, which this vLLM node cannot keep",
    EngineKind.SGLANG: "stage_to_cpu needs a weights backup: start SGLang with --enable-weights-cpu-backup",
}


def _refuse_unknown(state: NodeState, tags: list[str]) -> None:
    """409, nothing sent, for a tag whose state the engine's adapter does not know (a release or a resume of it,
    either way, might kill the engine)."""
    if state.unknown_tags.intersection(tags):
        raise Conflict(state.unknown_reason or "the state of the tags asked is not known: nothing was sent")


def _release_answer(released: list[str], already: list[str], change: MemoryChange, drained: int, aborted: int,
                    started: float) -> dict[str, Any]:
    return {"success": True, "released": released, "already_released": already, "bytes_freed": change.bytes,
            "bytes_measured_by": change.measured_by, "drained_requests": drained, "aborted_requests": aborted,
            "duration_s": round(time.perf_counter() - started, 6)}


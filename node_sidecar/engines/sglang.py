"""An SGLang server (0.5.23's HTTP API) behind the sidecar.

SGLang's own calls are unforgiving, so the adapter sends only what SGLang survives (line numbers: ``sglang/srt/`` of
0.5.23; the fake in ``tests/support/sglang_fake.py`` reproduces each):

- A release while anything runs fails an assertion and kills the server
  (``managers/scheduler_components/weight_updater.py:339``). The sidecar has drained already; the adapter then calls
  ``/flush_cache`` until SGLang says it is idle (it flushes only then, ``managers/scheduler.py:5518``) before the
  release, within :data:`IDLE_WAIT_S`; past it, 409 and nothing released. An update's flush is sent after it the
  same way (SGLang fails an update it cannot flush once loaded, ``weight_updater.py:119-130``).
- ``tags: []`` means every tag to SGLang (``weight_updater.py:345``), so an empty list is never sent; a tag already
  released is never released again (torch_memory_saver exits the process) and a tag not released is never resumed
  (``KeyError``, ``weight_updater.py:390``).
- Release and resume answer ``null`` (the sidecar measures what was freed). Weights resumed without
  ``--enable-weights-cpu-backup`` are garbage: ``weights_valid: false`` until ``update_weights_from_disk``.
- A disk reload SGLang fails after it began reading does not roll back (``model_runner_components/
  weight_updater.py:193``, 229-237; ``scheduler_components/weight_updater.py:117-130``: docs/engines.md). After its
  400, unless it says nothing was read (:data:`NOTHING_LOADED`), and after a reload it got but did not answer in
  time, the weights are taken as not valid (no generation, ``weights_valid: false``) until a reload succeeds.
- ``GET /health`` generates a token (fatal while released): liveness is ``GET /model_info``.
- SGLang's pause is read from it (``read_paused``: ``/ready`` 503, ``/ping`` 200): a sidecar restarted alone before
  a paused SGLang holds generation.
- SGLang does not say what it has released: the adapter remembers its own calls (:class:`ForeignEngine`: a new
  SGLang process, ``startup_time``, forgets them; one answered late is done; ``--state-file`` keeps them).
- Tensor and broadcast updates run only inside SGLang's update session (``begin_weight_update`` ..
  ``end_weight_update``, ``weight_updater.py:192``, ``234``): outside one they are refused before released weights
  are woken. Weights resumed as garbage are valid again after a reload, or when a session in which updates succeeded
  ends (the trainer's session is its word that every weight was sent; the sidecar cannot see the names inside a
  tensor payload).
- Every weight call answers ``{"success": bool, "message"}`` (``http_server.py:1302-1557``): a 2xx without
  ``"success": true``, or an error but its 400 JSON, is a 502 naming SGLang. A session call answered late still ran.
- A ``continue_generation`` while a tag is released or the weights are garbage is held back: SGLang would run the
  retracted requests on unmapped memory or on garbage. It is sent once every tag is resident and the weights are
  valid; with ``--state-file`` it is in the record until then, so a sidecar restarted meanwhile still sends it
  (unless SGLang reads as not paused).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from handoff.protocol import errors as E
from handoff.protocol.control import peer_weight_version
from handoff.protocol.engines import EngineKind
from handoff.protocol.tags import TAG_NAMES, TagState
from handoff.protocol.weights import MAX_TP_SIZE
from node_sidecar.engines.base import EngineView, MemoryChange, TagMeaning, tags_named
from node_sidecar.engines.foreign import ForeignEngine
from node_sidecar.engines.sglang_calls import (ACKNOWLEDGED, NOT_READ, RELOAD_FAILED, flush_after_update,
                                               memory_call, outside_session, reached_sglang, read_paused,
                                               reload_may_have_loaded, retracted_flush, sglang_call,
                                               sglang_not_understood, version_after, wait_idle)
from node_sidecar.errors import EngineRefused, EngineUnavailable

IDLE_WAIT_S = 10.0           # how long SGLang may take to look idle once the sidecar drained it
INFO_TIMEOUT_S = 5.0
WEIGHTS = "weights"
WEIGHT_UPDATES = frozenset({"/update_weights_from_tensor", "/update_weights_from_distributed"})
SESSION_CALLS = frozenset({"/begin_weight_update", "/end_weight_update"})
DISK_RELOAD = "/update_weights_from_disk"

log = logging.getLogger(__name__)


class SglangEngine(ForeignEngine):
    kind = EngineKind.SGLANG
    keeps_memory = True
    tag_meanings = {
        "weights": TagMeaning("weights", "the model's parameters; kept in host memory only with SGLang's "
                                         "--enable-weights-cpu-backup, else garbage after a resume until a reload"),
        "kv_cache": TagMeaning("kv_cache", "the KV pool; SGLang flushes its radix cache when releasing it"),
        "cuda_graph": TagMeaning("cuda_graph", "captured CUDA graphs"),
        "workspace": TagMeaning(None, "no region of its own in SGLang: tracked by the sidecar, frees nothing"),
    }
    health_path = "/model_info"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.has_backup = False
        self.memory_saver = False
        self.is_session_open = False  # SGLang's weight update session (a new SGLang process has none)
        self.updated_since_garbage = False  # an update succeeded in a session since the weights became garbage
        self.is_paused = False  # SGLang's own pause (retract, in_place)

    async def read_view(self) -> EngineView:
        info = await self.engine.call("GET", "/get_server_info", timeout=INFO_TIMEOUT_S)
        instance = info.get("startup_time")
        if not isinstance(instance, (dict, int, float)) or isinstance(instance, bool):
            # no process named: taken for a new one, it would forget every release SGLang still holds
            raise EngineRefused(502, {"error": {"type": E.UPSTREAM_ERROR.name, "message": (
                "SGLang's /get_server_info has no startup_time (an object in 0.5.23): not SGLang's answer, so the "
                "node's state is not read from it")}})
        model = await self.engine.call("GET", "/model_info", timeout=INFO_TIMEOUT_S)
        if self.adopt_instance(instance):
            # a process a sidecar before this one knew keeps what it recorded of its weights
            self.weights_garbage = self.adopted is not None and self.adopted.weights_garbage
            self.is_session_open = self.updated_since_garbage = False
            self.pending_continue = None if self.adopted is None else self.adopted.continue_held
        self.memory_saver = info.get("enable_memory_saver") is True
        self.has_backup = info.get("enable_weights_cpu_backup") is True
        self.device = str(info.get("device") or "cuda")
        path = model.get("model_path", info.get("model_path"))
        self.model_path = path if isinstance(path, str) else None
        version = model.get("weight_version")
        tp_size = info.get("tp_size")  # each TP rank joins a weight group as rank_offset + tp_rank
        paused = await read_paused(self.engine, INFO_TIMEOUT_S)
        self.is_paused = paused is True
        if paused is None:
            log.warning("SGLang's /ready and /ping do not say whether its generation is paused (not healthy?): "
                        "taken as not paused; a continue_generation lifts a pause it holds")
        if self.pending_continue is not None and paused is False:  # continued already (sent by a sidecar that
            self.pending_continue = None                           # died before recording it, or past the sidecar)
            await self.keep_record()
        if await self._send_pending_continue():  # a recorded continue whose tags and weights are back now
            paused = False
        return EngineView(
            tags={t: TagState.RELEASED if t in self.released | self.unknown else TagState.RESIDENT
                  for t in TAG_NAMES}, unknown=frozenset(self.unknown),
            unknown_reason=self.unknown_message() if self.unknown else None,
            weights_valid=not self.weights_garbage, weight_version=version if isinstance(version, str) else None,
            weights_backup="cpu" if self.has_backup else "none",
            memory_saver="torch_memory_saver" if self.memory_saver else "off", can_stage_weights=self.has_backup,
            tp_size=tp_size if type(tp_size) is int and 1 <= tp_size <= MAX_TP_SIZE else 1, instance=self.instance_key,
            paused=paused is True and self.pending_continue is None)  # a continue held back lifts it itself

    async def release(self, tags: list[str], *, stage_to_cpu: bool | None) -> MemoryChange:
        self.refuse_unknown(tags)
        sent = [t for t in tags if t not in self.released]
        engine_tags = tags_named(self.tag_meanings, sent)
        change: dict[str, int] = {}
        measured_by = None
        if engine_tags:
            await wait_idle(self.engine, IDLE_WAIT_S)
            async with self.memory_call(sent):
                try:
                    _, change, measured_by = await self.measured(
                        lambda: memory_call(self.engine, "/release_memory_occupation", engine_tags), engine_tags)
                except EngineUnavailable as exc:
                    if reached_sglang(exc):  # it will release them: never to be released twice
                        self.released.update(tags)
                    raise
                self.released.update(tags)
        self.released.update(tags)
        return MemoryChange(tags, change, measured_by)

    async def resume(self, tags: list[str]) -> MemoryChange:
        self.refuse_unknown(tags)
        sent = [t for t in tags if t in self.released]
        engine_tags = tags_named(self.tag_meanings, sent)
        change: dict[str, int] = {}
        measured_by = None
        if engine_tags:
            async with self.memory_call(sent):
                try:
                    _, change, measured_by = await self.measured(
                        lambda: memory_call(self.engine, "/resume_memory_occupation", engine_tags), engine_tags,
                        restoring=True)
                except EngineUnavailable as exc:
                    if reached_sglang(exc):  # it will resume them: never to be resumed twice
                        self._resumed(tags, engine_tags)
                    raise
                self._resumed(tags, engine_tags)
        self._resumed(tags, engine_tags)
        await self._send_pending_continue()
        return MemoryChange(tags, change, measured_by, weights_valid=not self.weights_garbage)

    def _resumed(self, tags: list[str], engine_tags: list[str]) -> None:
        self.released.difference_update(tags)
        if WEIGHTS in engine_tags and not self.has_backup:
            self.weights_garbage = True
            self.updated_since_garbage = False

    async def abort(self, *, rid: str | None, abort_all: bool) -> dict[str, Any]:
        await self.engine.call("POST", "/abort_request", {"abort_all": True} if abort_all else {"rid": rid})
        return {"success": True}

    async def check_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        await self.check_checkpoint(body["model_path"])
        return {"success": True, "dry_run": True, "message": f"{body['model_path']} can be loaded"}

    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self._update("/update_weights_from_disk", body)
        await self._send_pending_continue()
        return {**answer, "weights_valid": not self.weights_garbage}

    async def weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang has every weight call of its own API: passed through; an update (tensors, broadcast) resumes
        released weights first, as a reload does, and runs only inside SGLang's update session."""
        if path in WEIGHT_UPDATES:
            if not self.is_session_open:
                raise outside_session(path)
            answer = await self._update(path, body)
            return {**answer, "weights_valid": not self.weights_garbage}
        try:
            answer = await sglang_call(self.engine, path, body)
        except EngineUnavailable as exc:
            if path in SESSION_CALLS and reached_sglang(exc):  # it runs them in order, answered or not
                self.is_session_open = path == "/begin_weight_update"
            raise
        if path == "/begin_weight_update":
            self.is_session_open = True
        elif path == "/end_weight_update":
            self.is_session_open = False
            if self.weights_garbage and self.updated_since_garbage:
                self.weights_garbage = False
                await self.keep_record()
                await self._send_pending_continue()
            return {**answer, "weights_valid": not self.weights_garbage}
        elif path == "/update_weight_version" and "new_version" in answer and not isinstance(
                answer["new_version"], str):
            raise sglang_not_understood(path, "a new_version that is not a string")
        return answer

    async def _update(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Released weights are resumed first (SGLang would write into unmapped memory); the flush asked for is
        sent after the update (:func:`flush_after_update`) unless SGLang is paused or a tag out (then with it)."""
        self.refuse_unknown([WEIGHTS])
        resumed = []
        if WEIGHTS in self.released:
            await self.resume([WEIGHTS])
            resumed.append(WEIGHTS)
        flush_after = body.get("flush_cache", True) is not False and not (self.is_paused or self.has_tags_out)
        sent = {**body, "flush_cache": False} if flush_after else body
        async with self.reload_call() if path == DISK_RELOAD else contextlib.nullcontext():
            try:
                answer = {**await sglang_call(self.engine, path, sent, resumed=resumed), "success": True,
                          "resumed": resumed}
            except EngineRefused as exc:
                if path != DISK_RELOAD or not reload_may_have_loaded(exc):
                    raise
                self._weights_not_known()
                raise EngineRefused(exc.status, {"error": {"type": exc.type, "weights_valid": False, **exc.extra,
                                                           "message": f"{exc.message} ({RELOAD_FAILED})"}}) from exc
            except EngineUnavailable as exc:
                if path == DISK_RELOAD and reached_sglang(exc):  # the load runs on: how it ends is not known
                    self._weights_not_known()
                raise
            if path == DISK_RELOAD:  # every weight was read from the checkpoint
                self.weights_garbage, self.model_path = False, body["model_path"]
            else:
                self.updated_since_garbage = True
        version = body.get("weight_version")
        if version is None:  # SGLang kept its version: read, as a refresh
            version = await version_after(self.engine, path, INFO_TIMEOUT_S)
        if version is not NOT_READ:
            answer["weight_version"] = version if isinstance(version, str) else None
        answer["weights_valid"] = not self.weights_garbage
        if flush_after:
            await flush_after_update(self.engine, path, IDLE_WAIT_S, answer)
        return answer

    def _weights_not_known(self) -> None:
        """A reload that may have loaded part of the checkpoint: no generation until one succeeds."""
        self.weights_garbage = True
        self.updated_since_garbage = False

    async def pause(self, mode: str) -> dict[str, Any]:
        """SGLang's own ``retract`` / ``in_place`` pause; a release under it waits for the idle barrier, which
        ``in_place`` requests (their KV held) prevent: 409."""
        answer = await sglang_call(self.engine, "/pause_generation", {"mode": mode}, acknowledged=ACKNOWLEDGED)
        self.is_paused = True  # updates and flushes under it go to SGLang as they are (no retract, no flush after)
        return answer

    async def continue_generation(self, *, torch_empty_cache: bool) -> dict[str, Any]:
        """Sent now, or held back while a tag is released or the weights are garbage (module docstring); one held
        back is in the record (``--state-file``) until SGLang acknowledged it."""
        if self.has_tags_out or self.weights_garbage:
            self.pending_continue = torch_empty_cache
            await self.keep_record()
            return {"held_back": True}
        answer = await sglang_call(self.engine, "/continue_generation", {"torch_empty_cache": torch_empty_cache},
                                   acknowledged=ACKNOWLEDGED)
        self.is_paused = False
        if self.pending_continue is not None:
            self.pending_continue = None
            await self.keep_record()
        return answer

    async def _send_pending_continue(self) -> bool:
        """The continue held back, sent if nothing holds it any more; True if it was."""
        if self.pending_continue is not None and not (self.has_tags_out or self.weights_garbage):
            await self.continue_generation(torch_empty_cache=self.pending_continue)
            return True
        return False

    async def info(self, path: str) -> dict[str, Any] | None:
        if path != "/get_weight_version":  # not in SGLang 0.5.23: its /model_info carries the version
            return None
        model = await self.engine.call("GET", "/model_info", timeout=INFO_TIMEOUT_S)
        return {"weight_version": peer_weight_version(model.get("weight_version"))}

    async def flush_cache(self, timeout: float) -> dict[str, Any]:
        """Unless SGLang is paused already, its running requests retracted for the flush (:func:`retracted_flush`)."""
        if self.is_paused or self.has_tags_out:
            return {"success": True, "message": await wait_idle(self.engine, timeout, within_deadline=True)}
        return {"success": True, "message": await retracted_flush(self.engine, timeout)}

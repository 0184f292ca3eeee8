"""A vLLM OpenAI server behind the sidecar, through its dev endpoints (``VLLM_SERVER_DEV_MODE=1``).

Sleep levels and wake-up tags: :mod:`node_sidecar.engines.vllm_sleep`.

Reload (``update_weights_from_disk``): the checkpoint is checked by the
sidecar first (a reload vLLM cannot finish leaves its parameters on the meta
device and the next request kills the engine), released weights are woken,
then ``POST /collective_rpc {"method": "reload_weights"}``, the weight
version set with ``/update_weight_version``, the prefix cache reset.

Tensor and broadcast updates, the trainer's group and the update session go
through handoff's worker extension when vLLM runs with it
(:mod:`node_sidecar.engines.vllm_weights`); they end like a reload: the
version set, the prefix cache reset. Over released weights an update is staged
(received, checked) before the weights are woken to load it, so that a refused
one leaves them asleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from handoff.protocol import errors as E
from handoff.protocol.control import FLUSHED
from handoff.protocol.engines import EngineKind
from handoff.protocol.tags import TAG_NAMES, TagState
from handoff.protocol.weights import WEIGHTS_UPDATED_FULLY
from handoff.service.errors import Conflict, InvalidRequest, ServiceError, Unsupported
from node_sidecar.engines.base import EngineView, GenerationCall
from node_sidecar.engines.vllm_answer import Translator
from node_sidecar.engines.vllm_generate import PromptCounts, to_completion
from node_sidecar.engines.vllm_sleep import KV_CACHE, WEIGHTS, VllmSleep
from node_sidecar.engines.vllm_versions import ServedVersions
from node_sidecar.engines.vllm_weights import GROUP_CALLS, SESSION_CALLS, UPDATES, VllmWeightSync, WeightsLost
from node_sidecar.errors import EngineRefused, EngineUnavailable, LoadedNotFlushed

INFO_TIMEOUT_S = 30.0        # vLLM's first /server_info collects its environment: seconds
FLUSH_AFTER_UPDATE_S = 10.0  # how long an update's prefix-cache reset (running requests preempted) may take
RESET = "/reset_prefix_cache"
log = logging.getLogger(__name__)


class VllmEngine(VllmSleep):
    kind = EngineKind.VLLM

    def __init__(self, engine: Any, *, default_sleep_level: int = 1, weight_sync_timeout: float = 300.0) -> None:
        super().__init__(engine, default_sleep_level=default_sleep_level)
        self.weight_sync = VllmWeightSync(engine, timeout_s=weight_sync_timeout)
        self.sleep_mode = False
        self.versions = ServedVersions()  # the version served, and its renames (answers' weight_versions)
        self.version: str | None = None
        self.max_model_len: int | None = None  # vLLM's context: what a null max_new_tokens asks for
        self.logprobs_mode: str | None = None  # vLLM's --logprobs-mode: which logprobs mean SGLang's
        self._prompts_by_rid = PromptCounts()

    async def read_view(self) -> EngineView:
        try:
            info = await self.engine.call("GET", "/server_info?config_format=json", timeout=INFO_TIMEOUT_S)
        except EngineRefused as exc:
            if exc.status != 404:
                raise
            raise EngineUnavailable("vLLM's dev endpoints are off: start vLLM with VLLM_SERVER_DEV_MODE=1",
                                    retry_after=5) from exc
        sleeping = (await self.engine.call("GET", "/is_sleeping", timeout=INFO_TIMEOUT_S)).get("is_sleeping") is True
        config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
        model = config.get("model_config") if isinstance(config.get("model_config"), dict) else {}
        device = config.get("device_config") if isinstance(config.get("device_config"), dict) else {}
        parallel = config.get("parallel_config") if isinstance(config.get("parallel_config"), dict) else {}
        self.weight_sync.adopt_extension(parallel.get("worker_extension_cls"))
        if self.adopt_instance(config.get("instance_id")):
            self._forget_sleep()
        self.device = device.get("device") if isinstance(device.get("device"), str) and device["device"] else "cuda"
        self.sleep_mode = model.get("enable_sleep_mode") is True
        self.model_path = model.get("model") if isinstance(model.get("model"), str) else None
        mode = model.get("logprobs_mode")
        self.logprobs_mode = mode if isinstance(mode, str) and mode else None
        length = model.get("max_model_len")
        self.max_model_len = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 \
            else None
        self._adopt_sleeping(sleeping)
        version = (await self.engine.call("GET", "/weight_info", timeout=INFO_TIMEOUT_S)).get("weight_version")
        self.versions.rename(version if isinstance(version, str) else None)
        served = (await self.engine.call("GET", "/version", timeout=INFO_TIMEOUT_S)).get("version")
        self.version = served if isinstance(served, str) else None
        usable = self.sleep_mode or self.device == "cpu"  # on CPU the sleep endpoints answer, freeing nothing
        return EngineView(
            tags={t: TagState.RELEASED if t in self.released else TagState.RESIDENT for t in TAG_NAMES},
            weights_valid=not self.weights_discarded, weight_version=self.weight_version,
            weights_backup="cpu" if self.default_sleep_level == 1 else "none",
            memory_saver="vllm_sleep" if usable else "off", can_stage_weights=True, instance=self.instance_key)

    @property
    def weight_version(self) -> str | None:
        return self.versions.current

    # -- generation -------------------------------------------------------------------------------------------
    def generation_call(self, path: str, body: bytes, query: str) -> GenerationCall:
        if path != "/generate":
            return super().generation_call(path, body, query)
        completion, request = to_completion(body, max_model_len=self.max_model_len, logprobs_mode=self.logprobs_mode)
        if request.rid is not None:
            self._prompts_by_rid.add(request.rid, request.num_prompts)
        translator = Translator(request, self.versions)
        return GenerationCall("/v1/completions", completion, answer=translator.answer, stream=translator.stream)

    async def abort(self, *, rid: str | None, abort_all: bool) -> dict[str, Any]:
        # vLLM's ids for the prompts of a completion with request_id R are "cmpl-R-0", "cmpl-R-1", ... (one
        # prompt, or a greedy prompt sent n times); [] aborts everything
        ids = [] if abort_all else [f"cmpl-{rid}-{i}" for i in range(self._prompts_by_rid.get(rid or ""))]
        answer = await self.engine.call("POST", "/abort_requests", {"request_ids": ids})
        return {"success": True, "aborted": answer.get("aborted")}

    async def health_generate(self, timeout: float) -> str | None:
        await self.engine.call("POST", "/v1/completions", {"prompt": [0], "max_tokens": 1, "temperature": 0},
                               timeout=timeout, is_generation=True)
        return self.weight_version

    # -- weights and cache ------------------------------------------------------------------------------------
    async def check_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise Unsupported(f"load_format {body['load_format']!r} is not supported on vLLM nodes (safetensors "
                              "checkpoints only)", extra={"field": "load_format"})
        await self.check_checkpoint(body["model_path"])
        return {"success": True, "dry_run": True, "message": f"{body['model_path']} can be loaded"}

    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        resumed = await self._wake_weights_for_update()
        started = time.perf_counter()
        try:
            await self.engine.call("POST", "/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": body["model_path"]}})
        except EngineRefused as exc:
            self._lose_weights()  # a reload that failed part way leaves no usable weights
            raise EngineRefused(exc.status, {"error": {
                "type": E.ENGINE_FAILED.name, "resumed": resumed,
                "message": f"vLLM's reload_weights failed; its weights are not usable until a reload succeeds: "
                           f"{exc.message}"}}) from exc
        self._reloaded_weights(resumed)
        self.model_path = body["model_path"]
        return await self._finish_update(body, lambda: {
            "success": True, "weight_version": self.weight_version, "resumed": resumed, WEIGHTS_UPDATED_FULLY: True,
            "message": f"reloaded {body['model_path']} in {time.perf_counter() - started:.3f}s"})

    async def _finish_update(self, body: dict[str, Any], answer: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What every weight update ends with: the version it names, and (``flush_cache``, SGLang's default
        true) no prefix computed with the old weights; ``answer()`` (read once the version is) is returned, or
        carried by the 409 of a flush refused (:class:`LoadedNotFlushed`: the update is done all the same)."""
        if body.get("weight_version") is not None:
            await self.engine.call("POST", "/update_weight_version", {"new_version": body["weight_version"]})
            self.versions.rename(body["weight_version"])
        done = answer()
        if body.get("flush_cache", True) and KV_CACHE not in self.released:
            try:
                await self.flush_cache(FLUSH_AFTER_UPDATE_S)
            except Conflict as exc:  # never a success with the old weights' prefixes still cached
                raise LoadedNotFlushed(f"the weights are updated (version {self.weight_version!r}), but "
                                       f"{exc.message}: cached prefixes may still be the old weights'; call "
                                       "/flush_cache once the running requests end", done) from exc
        return done

    async def _push(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A tensor or broadcast update, ended as a reload is (version, prefix cache). Over released weights it
        is staged first (received, checked): a refused one changes nothing, and the weights wake only to load."""
        self.weight_sync.require(path)
        if WEIGHTS not in self.released:
            answer = await self._loading([], self.weight_sync.update(path, body, epoch=self.weights_epoch))
        else:
            try:
                await self.weight_sync.update(path, body, epoch=self.weights_epoch, stage=True)
                resumed = await self._wake_weights_for_update()
            except InvalidRequest:  # refused before anything was sent (selector "draft")
                raise
            except BaseException:  # refused on one worker, staged on another; the wake failed; the caller gone
                await asyncio.shield(self._drop_staged())  # staged tensors would hold memory given up by the sleep
                raise
            self._woke_weights_to_push()
            answer = await self._loading(resumed, self.weight_sync.load_staged(epoch=self.weights_epoch))
        complete = answer.pop("complete", False) is True or self.reloaded
        if complete:
            self._pushed_every_weight()
        try:
            return await self._finish_update(body, lambda: {
                **answer, "weight_version": self.weight_version, "weights_valid": not self.weights_discarded,
                WEIGHTS_UPDATED_FULLY: complete})
        except ServiceError as exc:  # the weights are loaded (and resident): the error says it woke them
            _tell_resumed(exc, answer["resumed"])
            raise

    async def _loading(self, resumed: list[str], load: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        """``load``'s answer with ``resumed``; its failure passed on with ``resumed``, the weights lost if it
        failed part way."""
        try:
            return {**await load, "resumed": resumed}
        except WeightsLost as exc:
            self._lose_weights()
            _tell_resumed(exc, resumed)
            raise EngineRefused(exc.status, {"error": {"type": exc.type, "message": exc.message,
                                                       **exc.extra}}) from exc
        except ServiceError as exc:
            _tell_resumed(exc, resumed)
            raise

    async def _drop_staged(self) -> None:
        try:
            await self.weight_sync.drop_staged()
        except (EngineRefused, EngineUnavailable) as exc:  # the refusal is the answer; the next update replaces it
            log.warning("dropping a staged weight update failed: %s", exc.message)

    async def flush_cache(self, timeout: float) -> dict[str, Any]:
        """``POST /reset_prefix_cache``; refused (running requests hold blocks), it is sent once more with
        ``reset_running_requests=true``: vLLM preempts them (back to its queue, their KV computed again, no token
        lost) and resets (or raises, a 500: 409 here). Waiting for an idle moment never ended under steady load.
        Each call is bounded by what is left of ``timeout``: none left is
        :func:`~node_sidecar.engine_client.deadline_spent`."""
        deadline = time.monotonic() + timeout
        for path in (RESET, RESET + "?reset_running_requests=true"):
            try:
                answer = await self.engine.call("POST", path, timeout=deadline - time.monotonic())
            except EngineRefused as exc:
                if exc.status != 500 or path == RESET:
                    raise
                answer = {}  # it raises when the reset fails with the running requests preempted
            if answer.get("success") is True:
                return {"success": True, "message": f"{FLUSHED} (vLLM's prefix cache was reset)"}
        raise Conflict("vLLM did not reset its prefix cache even with its running requests preempted (requests "
                       "waiting for a KV transfer hold blocks)", kind=E.REQUESTS_IN_FLIGHT)

    async def weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Of SGLang's other weight calls vLLM has the version (``/update_weight_version``); tensor and broadcast
        updates, the trainer's group and the update session go through handoff's worker extension."""
        if path in UPDATES:
            return await self._push(path, body)
        if path in GROUP_CALLS:
            return await self.weight_sync.group_call(path, body)
        if path in SESSION_CALLS:
            return self.weight_sync.session_call(path, body)
        if path != "/update_weight_version":
            raise Unsupported(f"{path} is not available on vLLM nodes (vLLM's own weight-transfer API takes "
                              "backend-specific arguments); reload from disk with /update_weights_from_disk",
                              extra={"path": path})
        aborted_at = None
        if body.get("abort_all_requests"):  # answers of the requests it ends keep the old version (as in SGLang)
            aborted_at = self.versions.abort_all()
            await self.abort(rid=None, abort_all=True)
        await self.engine.call("POST", "/update_weight_version", {"new_version": body["new_version"]})
        self.versions.rename(body["new_version"], aborted_at=aborted_at)
        return {"success": True, "message": f"Weight version updated to {self.weight_version}",
                "new_version": self.weight_version}

    async def info(self, path: str) -> dict[str, Any] | None:
        if path == "/get_server_info":
            return {"engine_kind": self.kind.value, "version": self.version, "model_path": self.model_path,
                    "device": self.device, "enable_sleep_mode": self.sleep_mode,
                    "sleep_level": self.default_sleep_level, "weight_version": self.weight_version,
                    "weight_sync": self.weight_sync.available}
        if path == "/get_weight_version":
            return {"weight_version": self.weight_version}
        return {"model_path": self.model_path, "is_generation": True, "weight_version": self.weight_version,
                "engine_kind": self.kind.value}  # /model_info, /get_model_info


def _tell_resumed(exc: ServiceError, resumed: list[str]) -> None:
    """An error after released weights were woken says so (``resumed``), as the answer would have."""
    if resumed:
        exc.extra["resumed"] = resumed

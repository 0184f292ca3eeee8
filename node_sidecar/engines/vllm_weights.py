"""SGLang's weight-sync calls on a vLLM node, through handoff's worker extension
(:mod:`node_sidecar.engines.vllm_worker_ext`, loaded by vLLM's ``--worker-extension-cls``).

Each call is one ``POST /collective_rpc`` naming an extension method (answers
``{"results": [one per worker]}``; a single worker here). The answers are
SGLang's shapes, as handoff's engine gives them:

- ``init_weights_update_group``: the join starts on the worker's own thread and
  is polled (``handoff_weight_group``) until joined, failed, or
  ``--vllm-weight-sync-timeout`` passed (then abandoned: 504
  ``weight_sync_timeout``); vLLM serves meanwhile.
- ``destroy_weights_update_group``: leaves, or abandons a join under way.
- ``update_weights_from_distributed`` / ``_from_tensor``: checked, received,
  loaded by the worker (see the extension); the adapter then sets the weight
  version and resets the prefix cache, as a reload from disk does. The worker
  counts what the updates wrote since the weights were last lost: a trainer's
  buckets together make discarded weights valid again, and lift a restarted
  engine's ``weights_stale`` (``weights_updated_fully``), once they wrote all.
- over released weights an update is staged first (received or decoded and
  checked, not loaded): a refusal leaves the weights asleep; the adapter wakes
  them only to load what was staged (``handoff_load_staged``).
- ``begin_weight_update`` / ``end_weight_update``: SGLang's session, kept here
  (one at a time); updates inside and outside it load the same way.

Without the extension each call is 400 ``unsupported`` saying how to start vLLM.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from handoff.protocol import errors as E
from handoff.protocol.engines import VLLM_WORKER_EXTENSION as EXTENSION
from handoff.service.errors import InvalidRequest, Unsupported
from node_sidecar.errors import EngineRefused

GROUP_CALLS = frozenset({"/init_weights_update_group", "/destroy_weights_update_group"})
SESSION_CALLS = frozenset({"/begin_weight_update", "/end_weight_update"})
UPDATES = frozenset({"/update_weights_from_distributed", "/update_weights_from_tensor"})
CALLS = GROUP_CALLS | SESSION_CALLS | UPDATES
DEFAULT_TIMEOUT_S = 300.0   # a join, or one update's broadcasts
POLL_S = 0.1
LOADS = frozenset({"handoff_update_from_distributed", "handoff_update_from_tensor", "handoff_load_staged"})
_ERRORS = {t.name: t for t in (E.INVALID_REQUEST, E.CONFLICT, E.WEIGHT_SYNC_BROKEN, E.WEIGHT_SYNC_TIMEOUT,
                               E.ENGINE_FAILED)}


class WeightsLost(EngineRefused):
    """The worker's load failed part way: the weights are not usable until a reload."""


class VllmWeightSync:
    def __init__(self, engine: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.extension: str | None = None   # vLLM's worker_extension_cls, read from /server_info
        self.session: str | None = None     # the selector of the open update session

    def adopt_extension(self, extension: object) -> None:
        """vLLM's ``worker_extension_cls`` as ``/server_info`` reports it (anything but a non-empty string: none)."""
        self.extension = extension if isinstance(extension, str) and extension else None

    @property
    def available(self) -> bool:
        return self.extension == EXTENSION

    def require(self, path: str) -> None:
        if not self.available:
            raise Unsupported(f"{path} on a vLLM node needs handoff's worker extension: start vLLM with "
                              f"--worker-extension-cls {EXTENSION} (handoff up --engine-kind vllm does), with "
                              "handoff installed in vLLM's environment; or reload from disk with "
                              "/update_weights_from_disk", extra={"path": path})

    async def rpc(self, method: str, timeout: float, **kwargs: Any) -> dict[str, Any]:
        """One extension method on every worker; a failure on any of them (its ``{"ok": false}`` answer, or an
        answer that is not one) raised as a handoff error, never a success. An update that loaded on some workers
        and failed on others leaves shards of two versions: :class:`WeightsLost`. Answers worker 0's result, its
        ``complete`` true only if every worker's is."""
        answer = await self.engine.call("POST", "/collective_rpc", {"method": method, "kwargs": kwargs,
                                                                    "timeout": timeout}, timeout=timeout + 30)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise EngineRefused(E.UPSTREAM_ERROR.status, {"error": {
                "type": E.UPSTREAM_ERROR.name, "message": f"vLLM's {method} answered {str(answer)[:200]}"}})
        failed = [(i, r) for i, r in enumerate(results) if r.get("ok") is not True]
        if failed:
            index, result = failed[0]
            kind = _ERRORS.get(str(result.get("error")), E.ENGINE_FAILED)
            mixed = method in LOADS and not kwargs.get("stage") and len(failed) < len(results)
            lost = mixed or any(r.get("weights_lost") is True for _, r in failed)
            error = WeightsLost if lost else EngineRefused
            where = f" (worker {index} of {len(results)}; {len(failed)} failed)" if len(results) > 1 else ""
            message = f"{str(result.get('message'))[:2000]}{where}"
            if mixed:
                message += "; the other workers loaded theirs, so the weights are not usable until a reload"
            raise error(kind.status, {"error": {"type": kind.name, "message": message}})
        return {**results[0], "complete": all(r.get("complete") is True for r in results)}

    async def group_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.require(path)
        name = body["group_name"]
        if path == "/destroy_weights_update_group":
            left = await self.rpc("handoff_leave_group", self.timeout_s, group_name=name)
            return {"success": True, "message": _field(left, "message", str, method="handoff_leave_group")}
        await self.rpc("handoff_join_group", self.timeout_s, body=body, timeout_s=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s + 5
        while True:
            state = await self.rpc("handoff_weight_group", 30, group_name=name)
            if _field(state, "state", str, method="handoff_weight_group") == "joined":
                return {"success": True, "message": "Succeeded to initialize custom process group.",
                        "rank": _field(state, "rank", int, method="handoff_weight_group"),
                        "world_size": _field(state, "world_size", int, method="handoff_weight_group")}
            if time.monotonic() > deadline:
                try:
                    await self.rpc("handoff_leave_group", 30, group_name=name)
                    abandoned = "the join was abandoned"
                except EngineRefused as exc:  # the timeout is still the answer; the failed abandon is told in it
                    abandoned = f"abandoning the join failed too ({exc.message}); destroy the group"
                raise EngineRefused(E.WEIGHT_SYNC_TIMEOUT.status, {"error": {
                    "type": E.WEIGHT_SYNC_TIMEOUT.name,
                    "message": f"joining group {name!r} at {body['master_address']}:{body['master_port']} as rank "
                               f"{body['rank_offset']} of {body['world_size']} took over {self.timeout_s:g}s (did "
                               "the trainer, rank 0, and every other rank join?); " + abandoned}})
            await asyncio.sleep(POLL_S)

    def session_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.require(path)
        if path == "/begin_weight_update":
            if body.get("selector") == "draft":
                raise InvalidRequest("this vLLM node has no draft model (selector 'draft')")
            if self.session is not None:
                raise InvalidRequest("a weight update session is already open; end it first")
            self.session = body.get("selector") or "all"
            return {"success": True, "message": "Weight update session begun."}
        if self.session is None:
            raise InvalidRequest("no weight update session is open (begin_weight_update first)")
        self.session = None
        return {"success": True, "message": "Weight update session ended."}

    async def update(self, path: str, body: dict[str, Any], *, epoch: str, stage: bool = False) -> dict[str, Any]:
        """Receive (or decode) and load on the worker; ``{"success", "message", "loaded", "complete",
        "duration_s"}``, ``complete`` true once the updates since ``epoch`` began (the adapter begins one whenever
        the weights are lost) have written every weight. ``stage``: received and checked, not loaded (``{"staged":
        n}``; :meth:`load_staged` loads it); a refusal, here or on any worker, changed nothing."""
        self.require(path)
        no_draft = "this vLLM node has no draft model (selector 'draft')" if body.get("selector") == "draft" else None
        started = time.perf_counter()
        if path == "/update_weights_from_distributed":  # refused, its broadcasts are still taken (group in step)
            result = await self.rpc("handoff_update_from_distributed", self.timeout_s, group_name=body["group_name"],
                                    names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
                                    flattened=body.get("load_format") == "flattened_bucket", refused=no_draft,
                                    epoch=epoch, stage=stage)
        elif no_draft is not None:
            raise InvalidRequest(no_draft)
        else:
            result = await self.rpc("handoff_update_from_tensor", self.timeout_s,
                                    serialized_named_tensors=body["serialized_named_tensors"],
                                    load_format=body.get("load_format"),
                                    release_sender_reference=body.get("release_sender_reference", True),
                                    epoch=epoch, stage=stage)
        if stage:
            return {"staged": _field(result, "staged", int, method="update")}
        return self._loaded(result, started)

    async def load_staged(self, *, epoch: str) -> dict[str, Any]:
        """Load the update :meth:`update` staged; answers as it does."""
        started = time.perf_counter()
        return self._loaded(await self.rpc("handoff_load_staged", self.timeout_s, epoch=epoch), started)

    async def drop_staged(self) -> None:
        """Free a staged update that will not be loaded."""
        await self.rpc("handoff_drop_staged", 30)

    @staticmethod
    def _loaded(result: dict[str, Any], started: float) -> dict[str, Any]:
        loaded = _field(result, "loaded", int, method="update")
        return {"success": True, "message": "Succeeded to update parameter online.", "loaded": loaded,
                "complete": result.get("complete") is True, "duration_s": round(time.perf_counter() - started, 6)}


def _field(result: dict[str, Any], key: str, kind: type, *, method: str) -> Any:
    """``result[key]`` of an extension's successful answer, checked to be a ``kind``; 502 otherwise."""
    value = result.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise EngineRefused(E.UPSTREAM_ERROR.status, {"error": {
            "type": E.UPSTREAM_ERROR.name, "message": f"vLLM's {method} answered {key}={str(value)[:200]}"}})
    return value

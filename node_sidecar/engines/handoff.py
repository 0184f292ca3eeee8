"""handoff's own engine (``python -m node_engine``): every SPEC call has the same name and body in the engine.

The engine keeps its per-tag state itself (``GET /memory_occupation``), frees
each tag separately and measures what it freed (``bytes_freed`` per tag), and
refuses a release while anything runs (409 ``requests_in_flight``), so this
adapter only passes calls through, and judges every answer before the sidecar
records anything from it (the engine is another process, maybe of another
version, maybe broken): a 2xx without ``"success": true``, a release or resume
that does not account for every tag asked, a tag list, byte count,
``weights_valid`` or ``weights_updated_fully`` of the wrong type is 502 ``upstream_error``; a state view
with a tag state other than ``resident`` / ``released`` or such a field is not
read (the node stays unsynced, ``last_error`` says why).
"""

from __future__ import annotations

import json
from typing import Any

from handoff.protocol.control import ENGINE_INSTANCE, MAX_NAME_CHARS
from handoff.protocol.tags import TAG_NAMES, Tag, TagState, is_byte_count, parse_tag_request
from handoff.protocol.weights import REFUSED_UPSTREAM_FIELD, WEIGHTS_UPDATED, WEIGHTS_UPDATED_FULLY
from handoff.service.errors import ServiceError
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import UpstreamError
from node_sidecar.engine_client import MAX_CONTROL_ANSWER_BYTES
from node_sidecar.engines.base import EngineAdapter, EngineKind, EngineView, MemoryChange, TagMeaning, not_understood
from node_sidecar.errors import EngineUnavailable

STATE_READ_TIMEOUT_S = 5.0   # reading the engine's state (a sync): the node serves only once it is read
MEMORY_VIEW_TIMEOUT_S = 1.0  # the figures of a view: a late answer leaves them out (the LB polls the view)
ENGINE = "handoff's engine"
KV_CACHE, WORKSPACE = Tag.KV_CACHE.value, Tag.WORKSPACE.value
ENGINE_TAG_STATES = (TagState.RESIDENT, TagState.RELEASED)  # the moves between are the sidecar's own
TAG_LISTS = ("released", "already_released", "resumed", "already_resident")
BYTE_COUNTS = ("bytes_freed", "bytes_restored")


class HandoffEngine(EngineAdapter):
    kind = EngineKind.HANDOFF
    tag_meanings = {
        "weights": TagMeaning("weights", "the model's parameters; kept on the CPU or disk with --weights-backup"),
        "kv_cache": TagMeaning("kv_cache", "the KV pool; every cached prefix is dropped on resume"),
        "cuda_graph": TagMeaning("cuda_graph", "captured decode graphs (GPU; empty on CPU)"),
        "workspace": TagMeaning("workspace", "attention and sampling scratch buffers"),
    }

    async def read_view(self) -> EngineView:
        occupation = await self.engine.call("GET", "/memory_occupation", timeout=STATE_READ_TIMEOUT_S)
        try:
            rows = occupation["tags"]
            tags = {t: _engine_tag_state(rows[t]["state"]) for t in TAG_NAMES}
            tag_bytes = {t: _byte_count(rows[t]["bytes"]) for t in TAG_NAMES}
            weights_valid = occupation["weights_valid"]
            if not isinstance(weights_valid, bool):
                raise ValueError(f"weights_valid is {_shown(weights_valid)}, not a boolean")
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"the engine's /memory_occupation cannot be read: {exc!r}",
                                    retry_after=1) from exc
        backup = str(occupation.get("weights_backup", "none"))
        return EngineView(tags=tags, tag_bytes=tag_bytes, weights_valid=weights_valid,
                          weight_version=occupation.get("weight_version"), weights_backup=backup,
                          memory_saver=str(occupation.get("memory_saver", "off")), can_stage_weights=backup != "none",
                          paused=occupation.get("paused") is True,
                          control_calls_pending=_count(occupation.get("control_calls_pending")),
                          instance=_instance(occupation.get(ENGINE_INSTANCE)),
                          weights_updated=occupation.get(WEIGHTS_UPDATED) is True, reports_tags=True)

    async def memory_view(self) -> dict[str, Any]:
        try:
            status, raw = await self.engine.peek("/memory_occupation", timeout=MEMORY_VIEW_TIMEOUT_S,
                                                 max_bytes=MAX_CONTROL_ANSWER_BYTES)
            occupation = loads_bounded(raw) if status == 200 else None
        except (UpstreamError, PeerJSONError):
            return {}  # a busy engine's late answer: the view goes out without its figures
        if not isinstance(occupation, dict):
            return {}
        rows = occupation.get("tags")
        tag_bytes = ({t: row["bytes"] for t, row in rows.items() if isinstance(row, dict)  # as read_view takes them
                      and is_byte_count(row.get("bytes"))}
                     if isinstance(rows, dict) else {})
        return {"tags": tag_bytes, "device": occupation.get("device"),
                "process_rss_bytes": occupation.get("process_rss_bytes")}

    def release_set(self, asked: list[str], resident: list[str]) -> list[str]:
        """The engine frees the workspace with ``kv_cache`` unless the workspace is released already (SGLang's
        clients know no workspace): a release again on a fresh engine of ``kv_cache`` alone, the workspace
        resumed since, names it too, so that the engine's answer accounts for what it did."""
        follows = WORKSPACE in resident and KV_CACHE in asked
        return [t for t in TAG_NAMES if t in asked or (follows and t == WORKSPACE)]

    async def release(self, tags: list[str], *, stage_to_cpu: bool | None) -> MemoryChange:
        body: dict[str, Any] = {"tags": tags}
        if stage_to_cpu is not None:
            body["stage_to_cpu"] = stage_to_cpu
        path = "/release_memory_occupation"
        answer = _accounting_for(path, await self._call(path, body), tags, "released", "already_released")
        return MemoryChange(list(answer.get("released", [])), dict(answer.get("bytes_freed", {})), "engine")

    async def resume(self, tags: list[str]) -> MemoryChange:
        path = "/resume_memory_occupation"
        answer = _accounting_for(path, await self._call(path, {"tags": tags}), tags, "resumed", "already_resident")
        return MemoryChange(list(answer.get("resumed", [])), dict(answer.get("bytes_restored", {})), "engine",
                            weights_valid=answer.get("weights_valid"))

    async def abort(self, *, rid: str | None, abort_all: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        return await self._call("/abort_request", body)

    async def check_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("/update_weights_from_disk", {**body, "dry_run": True})

    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("/update_weights_from_disk", body)

    async def flush_cache(self, timeout: float) -> dict[str, Any]:
        return await self._call("/flush_cache", timeout=timeout)

    async def weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(path, body)

    async def check_tensor_payload(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("/update_weights_from_tensor", {**body, "dry_run": True})

    async def discard_broadcasts(self, body: dict[str, Any]) -> None:
        """The engine refuses a body with a field no body takes (a 400) only after taking its broadcasts, and
        loads nothing."""
        try:
            await self._call("/update_weights_from_distributed", {**body, REFUSED_UPSTREAM_FIELD: True})
        except ServiceError as exc:
            if exc.status != 400:
                raise

    async def requests_running(self) -> int | None:
        occupation = await self.engine.call("GET", "/memory_occupation", timeout=STATE_READ_TIMEOUT_S)
        running, queued = occupation.get("running_requests"), occupation.get("queued_requests")
        if type(running) is int and type(queued) is int and running >= 0 and queued >= 0:
            return running + queued
        return None  # an engine of an older version: not told

    async def pause(self, mode: str) -> dict[str, Any]:
        return await self._call("/pause_generation", {"mode": mode})

    async def continue_generation(self, *, torch_empty_cache: bool) -> dict[str, Any]:
        return await self._call("/continue_generation", {"torch_empty_cache": torch_empty_cache})

    async def _call(self, path: str, body: dict[str, Any] | None = None, *,
                    timeout: float | None = None) -> dict[str, Any]:
        """``POST path``; the engine's answer, judged before anything is taken from it: every 2xx of the engine
        says ``"success": true``, and its tag lists, byte counts, ``weights_valid`` and ``weights_updated_fully``
        have their types."""
        answer = await self.engine.call("POST", path, body, timeout=timeout)
        if answer.get("success") is not True:
            raise not_understood(ENGINE, path, f'a 2xx without "success": true ({_shown(answer)})')
        for key in TAG_LISTS:
            value = answer.get(key, [])
            if not isinstance(value, list) or not all(isinstance(t, str) and t in TAG_NAMES for t in value):
                raise not_understood(ENGINE, path, f"{key} {_shown(value)}, not a list of tag names")
        for key in BYTE_COUNTS:
            value = answer.get(key, {})
            try:
                if not isinstance(value, dict):
                    raise ValueError("not an object")
                for count in value.values():
                    _byte_count(count)
            except ValueError as exc:
                raise not_understood(ENGINE, path, f"{key} {_shown(value)} ({exc})") from exc
        for key in ("weights_valid", WEIGHTS_UPDATED_FULLY):
            if not isinstance(answer.get(key, False), bool):
                raise not_understood(ENGINE, path, f"{key} {_shown(answer[key])}, not a boolean")
        return answer


def _instance(value: object) -> str | None:
    """The engine process's identity, if the engine names one (an engine of an older version does not)."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS else None


def _count(value: object) -> int:
    return value if type(value) is int and value > 0 else 0


def _accounting_for(path: str, answer: dict[str, Any], tags: list[str], done: str, already: str) -> dict[str, Any]:
    """``answer``, if its ``done`` and ``already`` lists hold exactly the ``tags`` asked (a tag the engine had
    already moved is in ``already``) and the workspace the engine adds to ``kv_cache`` (in ``already``: the
    sidecar sends ``kv_cache`` alone only when the workspace is moved already); 502 otherwise: the engine did
    not do what the sidecar would record."""
    moved = set(answer.get(done, []))
    named = moved | set(answer.get(already, []))
    if named != set(parse_tag_request(tags).names or []) or not moved <= set(tags):
        raise not_understood(ENGINE, path, f"{done} {_shown(answer.get(done))} and {already} "
                                           f"{_shown(answer.get(already))}, not the tags asked {tags}")
    return answer


def _engine_tag_state(value: object) -> TagState:
    """A tag state the engine may report: ``resident`` or ``released`` (ValueError otherwise)."""
    for state in ENGINE_TAG_STATES:
        if value == state.value:
            return state
    raise ValueError(f"a tag state {_shown(value)}, not resident or released")


def _byte_count(value: object) -> int:
    """A byte count of the engine's: an integer from 0 (ValueError otherwise)."""
    if not is_byte_count(value):
        raise ValueError(f"a byte count {_shown(value)}, not an integer from 0")
    return value


def _shown(value: object) -> str:
    return json.dumps(value)[:200]

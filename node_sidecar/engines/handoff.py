"""handoff's own engine (``python -m node_engine``): every SPEC call has the same name and body in the engine.

The engine keeps its per-tag state itself (``GET /memory_occupation``), frees
each tag separately and measures what it freed (``bytes_freed`` per tag), and
refuses a release while anything runs (409 ``requests_in_flight``), so this
adapter only passes calls through.
"""

from __future__ import annotations

from typing import Any

from handoff.protocol.tags import TAG_NAMES, TagState
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import UpstreamError
from node_sidecar.engine_client import MAX_CONTROL_ANSWER_BYTES
from node_sidecar.engines.base import EngineAdapter, EngineKind, EngineView, MemoryChange, TagMeaning
from node_sidecar.errors import EngineUnavailable

STATE_READ_TIMEOUT_S = 5.0   # reading the engine's state (a sync): the node serves only once it is read
MEMORY_VIEW_TIMEOUT_S = 1.0  # the figures of a view: a late answer leaves them out (the LB polls the view)


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
            tags = {t: TagState(rows[t]["state"]) for t in TAG_NAMES}
            tag_bytes = {t: int(rows[t]["bytes"]) for t in TAG_NAMES}
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineUnavailable(f"the engine's /memory_occupation cannot be read: {exc!r}",
                                    retry_after=1) from exc
        backup = str(occupation.get("weights_backup", "none"))
        return EngineView(tags=tags, tag_bytes=tag_bytes, weights_valid=bool(occupation.get("weights_valid")),
                          weight_version=occupation.get("weight_version"), weights_backup=backup,
                          memory_saver=str(occupation.get("memory_saver", "off")), can_stage_weights=backup != "none",
                          paused=occupation.get("paused") is True,
                          control_calls_pending=_count(occupation.get("control_calls_pending")))

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
        tag_bytes = ({t: row["bytes"] for t, row in rows.items() if isinstance(row, dict)
                      and isinstance(row.get("bytes"), int)} if isinstance(rows, dict) else {})
        return {"tags": tag_bytes, "device": occupation.get("device"),
                "process_rss_bytes": occupation.get("process_rss_bytes")}

    async def release(self, tags: list[str], *, stage_to_cpu: bool | None) -> MemoryChange:
        body: dict[str, Any] = {"tags": tags}
        if stage_to_cpu is not None:
            body["stage_to_cpu"] = stage_to_cpu
        answer = await self.engine.call("POST", "/release_memory_occupation", body)
        return MemoryChange(list(answer.get("released", tags)), dict(answer.get("bytes_freed", {})), "engine")

    async def resume(self, tags: list[str]) -> MemoryChange:
        answer = await self.engine.call("POST", "/resume_memory_occupation", {"tags": tags})
        valid = answer.get("weights_valid")
        return MemoryChange(list(answer.get("resumed", tags)), dict(answer.get("bytes_restored", {})), "engine",
                            weights_valid=valid if isinstance(valid, bool) else None)

    async def abort(self, *, rid: str | None, abort_all: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        return await self.engine.call("POST", "/abort_request", body)

    async def check_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.call("POST", "/update_weights_from_disk", {**body, "dry_run": True})

    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.call("POST", "/update_weights_from_disk", body)

    async def flush_cache(self, timeout: float) -> dict[str, Any]:
        return await self.engine.call("POST", "/flush_cache", timeout=timeout)

    async def weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.call("POST", path, body)

    async def pause(self, mode: str) -> dict[str, Any]:
        return await self.engine.call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self, *, torch_empty_cache: bool) -> dict[str, Any]:
        return await self.engine.call("POST", "/continue_generation", {"torch_empty_cache": torch_empty_cache})


def _count(value: object) -> int:
    return value if type(value) is int and value > 0 else 0

"""``GET /v1/loads``: the node's load in SGLang 0.5.23's shape (``entrypoints/v1_loads.py``, ``LoadSnapshot``).

slime's abort (``server_control.abort_server_until_idle``) posts ``/abort_request {"abort_all": true}`` to every
worker the router lists, then reads ``/v1/loads?include=core`` and aborts again until ``num_running_reqs`` +
``num_waiting_reqs`` is 0; without this route its read fails and it stops waiting at once. The node is one data
parallel rank (``dp_rank`` 0): ``num_running_reqs`` is the generation in flight through this sidecar (running
or queued in the engine, which the sidecar does not tell apart), ``num_waiting_reqs`` 0. The requests held while
the node is paused or released are in neither, as SGLang counts none of the requests waiting on its pause (its
tokenizer manager holds them before the scheduler sees them, and ``abort_all`` does not reach them either): a
loop aborting until the node is idle ends. The other core fields are
SGLang's defaults (0, ``decode_moments`` null): the sidecar does not measure them. No section (``memory``,
``spec``, ...) is ever filled, so SGLang leaves each out, whatever ``include`` asks for.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from handoff import __version__
from handoff.service.errors import InvalidRequest
from node_sidecar.node import Node

VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
# LoadSnapshot's flat fields, in its order, at SGLang's defaults
CORE_DEFAULTS: dict[str, Any] = {
    "timestamp": 0.0, "dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
    "num_used_tokens": 0, "num_total_tokens": 0, "num_active_tokens": 0, "num_prealloc_ready_tokens": 0,
    "max_total_num_tokens": 0, "max_running_requests": 0, "token_usage": 0.0, "gen_throughput": 0.0,
    "cache_hit_rate": 0.0, "utilization": 0.0, "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0,
    "decode_moments": None}
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def node_load(node: Node) -> dict[str, Any]:
    return CORE_DEFAULTS | {"timestamp": time.time(), "num_running_reqs": node.admission.num_in_flight}


def _include(raw: str | None) -> None:
    """SGLang's check of ``include`` (``LoadSnapshot.to_dict``): a section it does not know is a 400."""
    if not raw:
        return
    unknown = {part.strip() for part in raw.split(",")} - VALID_SECTIONS
    if unknown:
        raise InvalidRequest(f"Invalid include sections: {sorted(unknown)}. Valid options: {sorted(VALID_SECTIONS)}",
                             extra={"field": "include"})


def _dp_rank(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest("dp_rank must be an integer", extra={"field": "dp_rank"}) from None


def _prometheus(loads: list[dict[str, Any]]) -> Response:
    """SGLang's ``_format_loads_prometheus`` for flat fields: one gauge per numeric field, labelled by rank."""
    lines: list[str] = []
    for key in CORE_DEFAULTS:
        samples = [(load["dp_rank"], load[key]) for load in loads if key != "dp_rank"
                   and isinstance(load[key], (int, float)) and not isinstance(load[key], bool)]
        if samples:
            lines.append(f"# TYPE sglang_{key} gauge")
            lines += [f'sglang_{key}{{dp_rank="{rank}"}} {value}' for rank, value in samples]
    return Response("\n".join(lines) + "\n", media_type=PROMETHEUS_TYPE)


def loads_router() -> APIRouter:
    """Open, as the sidecar's other read-only views (``/get_server_info``): counts, no request's data."""
    router = APIRouter()

    @router.get("/v1/loads")
    async def loads(request: Request) -> Response:
        query = request.query_params
        _include(query.get("include"))
        dp_rank = _dp_rank(query.get("dp_rank"))
        node: Node = request.app.state.node
        found = [node_load(node)] if dp_rank in (None, 0) else []  # SGLang: a rank it has not is no load
        if query.get("format") == "prometheus":
            return _prometheus(found)
        return JSONResponse({"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
                             "accelerator": None, "num_accelerators": 1, "loads": found})

    return router

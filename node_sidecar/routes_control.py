"""The sidecar's control endpoints (SPEC section 3): admin token, strict bodies, one call at a time.

The work is :class:`~node_sidecar.control.ControlPlane`'s; here the bodies are
parsed, tag lists read (null: all, ``[]``: none) and a drain bounded by the
caller's deadline (:data:`~handoff.protocol.control.DEADLINE_HEADER`).
"""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from handoff.protocol.control import (
    DEADLINE_HEADER,
    AbortBody,
    ContinueBody,
    PauseBody,
    ReleaseBody,
    ResumeBody,
    UpdateWeightsFromDiskBody,
)
from handoff.protocol import errors as E
from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body, parse_body, parse_tag_names, parse_value
from handoff.service.disconnect import CLIENT_CLOSED, ClientGone, unless_disconnected
from handoff.service.errors import InvalidRequest, ServiceError, parse_json_bytes
from node_sidecar.config import SidecarConfig
from node_sidecar.control import ControlPlane
from node_sidecar.control_drain import DrainLimit

CONTROL_BODIES = [ReleaseBody, ResumeBody, PauseBody, ContinueBody, UpdateWeightsFromDiskBody, AbortBody]


def answer_by(request: Request) -> float | None:
    """When the caller stops waiting (event-loop time), from :data:`DEADLINE_HEADER`, less a margin for the work
    after the drain and the answer's way back; None without the header. Raised before anything is done: a header
    that is not a finite number of seconds is a 400 naming it; one of 0 or less (the caller's deadline already
    past) is a 504 ``upstream_timeout`` at once."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        deadline = float(raw)
    except ValueError:
        deadline = math.nan
    if not math.isfinite(deadline):
        raise InvalidRequest(f"{DEADLINE_HEADER} must be the seconds the caller waits (a finite number), got "
                             f"{raw[:64]!r}; nothing was done")
    if deadline <= 0:
        raise ServiceError(f"{DEADLINE_HEADER} is {raw[:64]!r}: the caller's deadline is already past, so "
                           f"{request.method} {request.url.path} was not started; nothing changed",
                           kind=E.UPSTREAM_TIMEOUT, extra={"sent": False})
    margin = min(max(0.5, 0.1 * deadline), deadline / 2)
    return asyncio.get_running_loop().time() + deadline - margin


def control_router(config: SidecarConfig, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    def control_of(request: Request) -> ControlPlane:
        return request.app.state.control

    def drain_limit(request: Request, value: float | None) -> DrainLimit:
        """The body's ``drain_timeout`` (or the default), cut to what the caller's deadline header leaves."""
        if value is not None and value > config.max_drain_timeout:
            raise InvalidRequest(f"drain_timeout must be at most {config.max_drain_timeout:g} s")
        return DrainLimit(config.drain_timeout if value is None else value, answer_by(request))

    @router.post("/release_memory_occupation", openapi_extra=openapi_body(ReleaseBody, required=False))
    async def release(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, ReleaseBody, empty_ok=True)
        asked = parse_tag_names(body.tags)  # as SGLang clients name them: workspace follows kv_cache
        answer = await control_of(request).release(asked.names, mode=body.mode,
                                                   drain=drain_limit(request, body.drain_timeout),
                                                   stage_to_cpu=body.stage_to_cpu)
        return JSONResponse(asked.report(answer))

    @router.post("/resume_memory_occupation", openapi_extra=openapi_body(ResumeBody, required=False))
    async def resume(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, ResumeBody, empty_ok=True)
        asked = parse_tag_names(body.tags)
        answer_by(request)  # nothing to bound, but a spent deadline or a malformed header is answered first
        answer = await control_of(request).resume(asked.names)
        return JSONResponse(asked.report(answer))

    @router.post("/update_weights_from_disk", openapi_extra=openapi_body(UpdateWeightsFromDiskBody))
    async def update_weights(request: Request) -> JSONResponse:
        admin.check(request)
        raw = await request.body()
        body = parse_value(parse_json_bytes(raw) if raw.strip() else None, UpdateWeightsFromDiskBody)
        engine_body = body.engine_body(exclude=frozenset({"drain_timeout", "dry_run", "abort_all_requests",
                                                          "keep_pause"}), exclude_none=True)
        control = control_of(request)
        drain = drain_limit(request, body.drain_timeout)
        if body.dry_run:  # only the check: nothing drains, nothing loads
            return JSONResponse(await control.check_weights(engine_body))
        adapter = control.node.engine_adapter
        answer = await control.update_weights(
            lambda: adapter.update_weights_from_disk(engine_body), drain=drain,
            mode="abort" if body.abort_all_requests else "wait",
            check=lambda: adapter.check_weights(engine_body))
        return JSONResponse(answer)

    @router.post("/pause_generation", openapi_extra=openapi_body(PauseBody, required=False))
    async def pause_generation(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, PauseBody, empty_ok=True)
        return JSONResponse(await control_of(request).pause(mode=body.mode,
                                                            drain=drain_limit(request, body.drain_timeout)))

    @router.post("/continue_generation", openapi_extra=openapi_body(ContinueBody, required=False))
    async def continue_generation(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, ContinueBody, empty_ok=True)
        answer_by(request)
        return JSONResponse(await control_of(request).resume_generation(torch_empty_cache=body.torch_empty_cache))

    async def flush_cache(request: Request) -> Response:
        """An engine that flushes only when idle is asked again until the deadline, holding the control lock: a
        client that leaves stops that at once (else every release waited behind a flush nobody reads)."""
        admin.check(request)
        try:
            await request.body()  # read first: the watch for the client leaving takes over the request's receive
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        flushing = control_of(request).flush_cache(DrainLimit(config.control_timeout, answer_by(request)))
        try:
            return JSONResponse(await unless_disconnected(request, flushing))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    for method in ("GET", "POST"):  # one route per method: one operation id each in the schema
        router.add_api_route("/flush_cache", flush_cache, methods=[method], name=f"flush_cache_{method.lower()}")

    @router.post("/abort_request", openapi_extra=openapi_body(AbortBody))
    async def abort_request(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, AbortBody)
        answer_by(request)
        if body.rid is None and not body.abort_all:
            raise InvalidRequest("give a rid, or abort_all: true")
        node = control_of(request).node
        node.require_engine()
        return JSONResponse(await node.engine_adapter.abort(rid=body.rid, abort_all=body.abort_all))

    return router

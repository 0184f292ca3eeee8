"""Memory, weights and introspection endpoints of the engine."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest, NotFound
from node_engine.engine import Engine
from handoff.protocol.control import AbortBody, ReleaseBody, ResumeBody, UpdateWeightsFromDiskBody
from node_engine.memory.tags import MemoryTag, UnknownTag, parse_tags

router = APIRouter()


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _tags(names: list[str] | None) -> tuple[MemoryTag, ...] | None:
    try:
        return parse_tags(names)
    except UnknownTag as exc:
        raise InvalidRequest(str(exc)) from exc


@router.post("/release_memory_occupation", openapi_extra=openapi_body(ReleaseBody, required=False))
async def release_memory_occupation(request: Request) -> JSONResponse:
    """``mode`` and ``drain_timeout`` are the sidecar's: the engine itself never drains, it refuses (409)."""
    engine = _engine(request)
    body = await parse_body(request, ReleaseBody, empty_ok=True)
    tags = _tags(body.tags)
    return JSONResponse(await engine.call(lambda: engine.control.release(tags, body.stage_to_cpu)))


@router.post("/resume_memory_occupation", openapi_extra=openapi_body(ResumeBody, required=False))
async def resume_memory_occupation(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, ResumeBody, empty_ok=True)
    tags = _tags(body.tags)
    return JSONResponse(await engine.call(lambda: engine.control.resume(tags)))


@router.post("/update_weights_from_disk", openapi_extra=openapi_body(UpdateWeightsFromDiskBody))
async def update_weights_from_disk(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, UpdateWeightsFromDiskBody)
    if body.load_format not in (None, "auto", "safetensors"):
        raise InvalidRequest(f"load_format {body.load_format!r} is not supported; use safetensors")
    if body.dry_run:
        return JSONResponse(await asyncio.to_thread(engine.control.check_weights, body.model_path))
    return JSONResponse(await engine.call(lambda: engine.control.update_weights_from_disk(body.model_path,
                                                                                         body.weight_version)))


async def flush_cache(request: Request) -> JSONResponse:
    engine = _engine(request)
    return JSONResponse(await engine.call(engine.control.flush_cache))


for _method in ("GET", "POST"):  # one route per method: one operation id each in the schema
    router.add_api_route("/flush_cache", flush_cache, methods=[_method], name=f"flush_cache_{_method.lower()}")


@router.post("/abort_request", openapi_extra=openapi_body(AbortBody))
async def abort_request(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, AbortBody)
    if body.abort_all == (body.rid is not None):
        raise InvalidRequest("give either rid or abort_all: true")
    if body.rid is not None:
        if engine.scheduler.find(body.rid) is None:
            raise NotFound(f"no running or queued request {body.rid!r}")
        engine.abort(body.rid)
        return JSONResponse({"success": True, "aborted": [body.rid]})
    engine.abort(None)
    return JSONResponse({"success": True, "aborted": "all"})


@router.get("/memory_occupation")
async def memory_occupation(request: Request) -> JSONResponse:
    return JSONResponse(_engine(request).control.occupation())


@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    engine = _engine(request)
    config = engine.config
    arch = engine.arch
    return JSONResponse({
        "model_path": config.model_path, "served_model_name": config.model_name, "device": config.device,
        "dtype": config.resolved_dtype, "role": config.role, "weight_version": engine.weight_version,
        "architecture": arch.architecture, "num_parameters": arch.num_params(),
        "context_length": engine.runner.kv_plan.context_len, "max_total_tokens": engine.scheduler.slots.capacity,
        "max_batch_tokens": config.max_batch_tokens, "max_running_requests": config.max_running_requests,
        "memory_saver": engine.saver.name, "weights_backup": config.weights_backup.value,
        "cuda_graph": engine.runner.graphs is not None, "torch_compile": config.enable_torch_compile,
        "memory": engine.control.occupation(),
    })


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = _engine(request)
    if not engine.is_alive:
        return JSONResponse({"status": "engine thread stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_engine(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

"""Memory, abort and introspection endpoints of the engine (weights: :mod:`routes_weights`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from handoff.service.bodies import openapi_body, parse_body, parse_tag_names
from node_engine.engine import Engine
from handoff.protocol.control import AbortBody, ContinueBody, PauseBody, ReleaseBody, ResumeBody
from handoff.service.errors import InvalidRequest

router = APIRouter()


def _engine(request: Request) -> Engine:
    return request.app.state.engine


@router.post("/release_memory_occupation", openapi_extra=openapi_body(ReleaseBody, required=False))
async def release_memory_occupation(request: Request) -> JSONResponse:
    """``mode`` and ``drain_timeout`` are the sidecar's: the engine itself never drains, it refuses (409)."""
    engine = _engine(request)
    body = await parse_body(request, ReleaseBody, empty_ok=True)
    asked = parse_tag_names(body.tags)
    answer = await engine.call(lambda: engine.control.release(asked.tags, body.stage_to_cpu))
    return JSONResponse(asked.report(answer))


@router.post("/resume_memory_occupation", openapi_extra=openapi_body(ResumeBody, required=False))
async def resume_memory_occupation(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, ResumeBody, empty_ok=True)
    asked = parse_tag_names(body.tags)
    answer = await engine.call(lambda: engine.control.resume(asked.tags))
    return JSONResponse(asked.report(answer))


async def flush_cache(request: Request) -> JSONResponse:
    engine = _engine(request)
    return JSONResponse(await engine.call(engine.control.flush_cache))


for _method in ("GET", "POST"):  # one route per method: one operation id each in the schema
    router.add_api_route("/flush_cache", flush_cache, methods=[_method], name=f"flush_cache_{_method.lower()}")


@router.post("/abort_request", openapi_extra=openapi_body(AbortBody))
async def abort_request(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, AbortBody)
    if body.abort_all:
        engine.abort(None)
        return JSONResponse({"success": True, "aborted": "all"})
    # SGLang's semantics: an empty or unknown rid is a no-op (its request may have finished a moment ago). The
    # gate knows every request accepted and not yet answered, the ones still in the engine's inbox included.
    if not body.rid or not engine.gate.is_live(body.rid):
        return JSONResponse({"success": True, "aborted": []})
    engine.abort(body.rid)
    return JSONResponse({"success": True, "aborted": [body.rid]})


@router.post("/pause_generation", openapi_extra=openapi_body(PauseBody, required=False))
async def pause_generation(request: Request) -> JSONResponse:
    """SGLang's modes: ``abort`` (abort all, then pause), ``retract``, ``in_place``. ``wait`` is the sidecar's."""
    engine = _engine(request)
    body = await parse_body(request, PauseBody, empty_ok=True)
    if body.mode == "wait":
        raise InvalidRequest("mode wait drains generation first: the sidecar does that, the engine does not")
    if body.mode == "abort":
        engine.abort(None)
    return JSONResponse(await engine.call(lambda: engine.control.pause(body.mode)))


@router.post("/continue_generation", openapi_extra=openapi_body(ContinueBody, required=False))
async def continue_generation(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, ContinueBody, empty_ok=True)
    return JSONResponse(await engine.call(lambda: engine.control.continue_generation(body.torch_empty_cache)))


@router.get("/memory_occupation")
async def memory_occupation(request: Request) -> JSONResponse:
    return JSONResponse(_engine(request).control.occupation())


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> JSONResponse:
    engine = _engine(request)
    config = engine.config
    arch = engine.arch
    return JSONResponse({
        "model_path": engine.weights.model_path, "served_model_name": config.model_name, "device": config.device,
        "dtype": config.resolved_dtype, "role": config.role, "weight_version": engine.weight_version,
        "architecture": arch.architecture, "num_parameters": arch.num_params(),
        "context_length": engine.runner.kv_plan.context_len, "max_total_tokens": engine.scheduler.slots.capacity,
        # SGLang's scheduler fields (its ``get_init_info``): the pool's tokens, and the longest prompt taken plus one
        "max_total_num_tokens": engine.scheduler.slots.capacity, "max_req_input_len": engine.gate.max_input_tokens(),
        "max_batch_tokens": config.max_batch_tokens, "max_running_requests": config.max_running_requests,
        "memory_saver": engine.saver.name, "weights_backup": config.weights_backup.value,
        "cuda_graph": engine.runner.graphs is not None, "torch_compile": config.enable_torch_compile,
        "memory": engine.control.occupation(), "vision": _vision_info(engine),
        "weight_groups": engine.weight_groups.view(),
    })


def _vision_info(engine: Engine) -> dict[str, Any] | None:
    """A vision-language engine's image caps (after the clamp) and its reservation in ``workspace``."""
    vision = engine.vision
    if vision is None:
        return None
    reservation, processor = vision.reservation, vision.processor.config
    return {"image_token_id": engine.arch.vision.image_token_id, "max_image_tokens": vision.max_image_tokens,
            "visual_batch_max_tokens": vision.visual_budget, "min_pixels": processor.min_pixels,
            "max_pixels": processor.max_pixels,
            "reservation_bytes": reservation.num_bytes if reservation is not None else 0}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = _engine(request)
    if not engine.is_alive:
        return JSONResponse({"status": "engine thread stopped"}, status_code=503)
    running_s, bound_s = engine.steps.running_for(), engine.config.health_step_timeout
    if running_s > bound_s:  # the thread lives but its step never returns: only a restart helps
        return JSONResponse({"status": f"a step has run for {running_s:.0f} s, past --health-step-timeout "
                                       f"({bound_s:g} s)"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_engine(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

"""Weight endpoints of the engine: updates from disk, tensors and broadcasts, the session, the version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from handoff.protocol.control import UpdateWeightsFromDiskBody
from handoff.protocol.weights import (BeginWeightUpdateBody, DestroyWeightsUpdateGroupBody, EndWeightUpdateBody,
                                      InitWeightsUpdateGroupBody, UpdateWeightsFromDistributedBody,
                                      UpdateWeightsFromTensorBody, UpdateWeightVersionBody, WeightsCheckerBody)
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest, Unsupported, parse_json_bytes
from node_engine.engine import Engine

router = APIRouter()

DISK_LOAD_FORMATS = (None, "auto", "safetensors")


def _engine(request: Request) -> Engine:
    return request.app.state.engine


@router.post("/update_weights_from_disk", openapi_extra=openapi_body(UpdateWeightsFromDiskBody))
async def update_weights_from_disk(request: Request) -> JSONResponse:
    """SGLang's body. ``abort_all_requests`` and ``keep_pause`` are the sidecar's (it drains or aborts first)."""
    engine = _engine(request)
    body = await parse_body(request, UpdateWeightsFromDiskBody)
    if body.load_format not in DISK_LOAD_FORMATS:
        raise Unsupported(f"load_format {body.load_format[:200]!r} is not supported by this engine; use "
                          "safetensors (or auto)")
    if body.dry_run:
        return JSONResponse(await engine.weights.check_disk(body.model_path))
    return JSONResponse(await engine.weights.update_from_disk(body))


@router.post("/update_weights_from_tensor", openapi_extra=openapi_body(UpdateWeightsFromTensorBody))
async def update_weights_from_tensor(request: Request) -> JSONResponse:
    """SGLang's body; the payload is unpickled by a restricted unpickler (tensors and storages only)."""
    engine = _engine(request)
    body = await parse_body(request, UpdateWeightsFromTensorBody)
    if body.dry_run:
        return JSONResponse(await engine.weights.check_tensor_payload(body))
    return JSONResponse(await engine.weights.update_from_tensor(body))


@router.post("/init_weights_update_group", openapi_extra=openapi_body(InitWeightsUpdateGroupBody))
async def init_weights_update_group(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, InitWeightsUpdateGroupBody)
    return JSONResponse(await engine.weight_groups.init(body))


@router.post("/update_weights_from_distributed", openapi_extra=openapi_body(UpdateWeightsFromDistributedBody))
async def update_weights_from_distributed(request: Request) -> JSONResponse:
    """A body refused as read still has its broadcasts taken (or its group marked out of step): the trainer sends
    them whatever the answer."""
    engine = _engine(request)
    try:
        body = await parse_body(request, UpdateWeightsFromDistributedBody)
    except InvalidRequest as exc:
        raw = await request.body()
        raise await engine.weight_groups.refused(parse_json_bytes(raw) if raw.strip() else None, exc) from exc
    return JSONResponse(await engine.weight_groups.update(body))


@router.post("/destroy_weights_update_group", openapi_extra=openapi_body(DestroyWeightsUpdateGroupBody, required=False))
async def destroy_weights_update_group(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, DestroyWeightsUpdateGroupBody, empty_ok=True)
    return JSONResponse(await engine.weight_groups.destroy(body))


@router.post("/begin_weight_update", openapi_extra=openapi_body(BeginWeightUpdateBody, required=False))
async def begin_weight_update(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, BeginWeightUpdateBody, empty_ok=True)
    return JSONResponse(await engine.call(lambda: engine.weights.begin_session(body)))


@router.post("/end_weight_update", openapi_extra=openapi_body(EndWeightUpdateBody, required=False))
async def end_weight_update(request: Request) -> JSONResponse:
    engine = _engine(request)
    await parse_body(request, EndWeightUpdateBody, empty_ok=True)
    return JSONResponse(await engine.call(engine.weights.end_session))


@router.post("/update_weight_version", openapi_extra=openapi_body(UpdateWeightVersionBody))
async def update_weight_version(request: Request) -> JSONResponse:
    engine = _engine(request)
    body = await parse_body(request, UpdateWeightVersionBody)
    if body.abort_all_requests:
        engine.abort(None)
    return JSONResponse(await engine.call(lambda: engine.weights.update_version(body)))


async def weights_checker(request: Request) -> JSONResponse:
    """SGLang's: ``{"success", "message"}`` (plus ``ranks`` and ``per_engine_checksum`` for a checksum), 200 or
    400 (:mod:`node_engine.weights_checker`); on the engine thread, between two steps."""
    engine = _engine(request)
    body = await parse_body(request, WeightsCheckerBody, empty_ok=True)
    status, answer = await engine.call(lambda: engine.weights.checker.handle(body))
    return JSONResponse(answer, status_code=status)


for _method in ("GET", "POST"):  # one operation id each in the schema
    router.add_api_route("/weights_checker", weights_checker, methods=[_method],
                         name=f"{_method.lower()}_weights_checker",
                         openapi_extra=openapi_body(WeightsCheckerBody, required=False))


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> JSONResponse:
    return JSONResponse({"weight_version": _engine(request).weight_version})


async def model_info(request: Request) -> JSONResponse:
    """SGLang's ``/model_info`` (``/get_model_info`` is its older name): what is served now."""
    engine = _engine(request)
    config = engine.config
    return JSONResponse({
        "model_path": engine.weights.model_path, "served_model_name": config.model_name,
        "tokenizer_path": config.model_path, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": engine.weight_version, "token_step": engine.weights.token_step,
        "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": engine.vision is not None, "has_audio_understanding": False,
        "model_type": engine.arch.architecture.removesuffix("ForCausalLM").lower(),
        "architectures": [engine.arch.architecture],
    })


for _path in ("/get_model_info", "/model_info"):
    router.add_api_route(_path, model_info, methods=["GET"], name=_path.strip("/"))

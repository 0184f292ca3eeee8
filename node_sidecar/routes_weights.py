"""The sidecar's weight routes (admin): updates from tensors and broadcasts, the trainer's group, SGLang's
update session, the served version.

Every call goes through the node's engine adapter (``weight_call``; handoff's
engine has them all). Updates run like a reload
(:meth:`ControlPlane.update_weights`): under the control lock, after draining
generation (aborting it with ``abort_all_requests``; nothing is drained while
generation is paused). Group joins and leaves are not serialized with other
control calls (a join waits for the trainer, up to the engine's
``--weight-sync-timeout``); the engine orders them among themselves.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response

from handoff.protocol.weights import (BeginWeightUpdateBody, DestroyWeightsUpdateGroupBody, EndWeightUpdateBody,
                                      InitWeightsUpdateGroupBody, UpdateWeightsFromDistributedBody,
                                      UpdateWeightsFromTensorBody, UpdateWeightVersionBody, WeightUpdateCommon)
from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body, parse_body
from node_sidecar.config import SidecarConfig
from node_sidecar.control import ControlPlane, DrainLimit
from node_sidecar.node import Node
from node_sidecar.proxy import forward
from node_sidecar.routes_control import answer_by


def _control_of(request: Request) -> ControlPlane:
    return request.app.state.control


def _node_of(request: Request) -> Node:
    return request.app.state.node


def weight_router(config: SidecarConfig, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    def update_route(path: str, model: type[WeightUpdateCommon]) -> None:
        async def update(request: Request) -> JSONResponse:
            admin.check(request)
            body = (await parse_body(request, model)).model_dump(exclude_none=True)
            control = _control_of(request)
            return JSONResponse(await control.update_weights(
                lambda: control.node.engine_adapter.weight_call(path, body),
                drain=DrainLimit(config.drain_timeout, answer_by(request)),
                mode="abort" if body.get("abort_all_requests") else "wait"))

        router.add_api_route(path, update, methods=["POST"], openapi_extra=openapi_body(model),
                             name=path.strip("/"))

    update_route("/update_weights_from_tensor", UpdateWeightsFromTensorBody)
    update_route("/update_weights_from_distributed", UpdateWeightsFromDistributedBody)

    def call_route(path: str, model: type[BaseModel], *, serialized: bool) -> None:
        """Checked here, done by the engine; ``serialized``: one at a time with the other control calls (a join
        is not: it waits for the trainer, and a destroy must be able to abandon it)."""
        empty_ok = not any(field.is_required() for field in model.model_fields.values())

        async def call(request: Request) -> JSONResponse:
            admin.check(request)
            body = (await parse_body(request, model, empty_ok=empty_ok)).model_dump()
            control = _control_of(request)
            if serialized:
                return JSONResponse(await control.weight_call(path, body))
            control.node.require_engine()
            return JSONResponse(await control.node.engine_adapter.weight_call(path, body))

        router.add_api_route(path, call, methods=["POST"], openapi_extra=openapi_body(model, required=not empty_ok),
                             name=path.strip("/"))

    call_route("/init_weights_update_group", InitWeightsUpdateGroupBody, serialized=False)
    call_route("/destroy_weights_update_group", DestroyWeightsUpdateGroupBody, serialized=False)
    call_route("/begin_weight_update", BeginWeightUpdateBody, serialized=True)
    call_route("/end_weight_update", EndWeightUpdateBody, serialized=True)
    call_route("/update_weight_version", UpdateWeightVersionBody, serialized=True)

    async def read_only(request: Request) -> Response:
        node = _node_of(request)
        info = None if node.adapter is None else await node.adapter.info(request.url.path)
        return JSONResponse(info) if info is not None else await forward(node, request, request.url.path)

    for path in ("/get_weight_version", "/get_model_info", "/model_info"):
        router.add_api_route(path, read_only, methods=["GET"], name=path.strip("/"))
    return router

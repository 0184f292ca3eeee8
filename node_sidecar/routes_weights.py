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

import asyncio
import logging
from collections import Counter
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from handoff.protocol.control import SGLangRequest
from handoff.protocol.weights import (DEFAULT_GROUP_NAME, DESTROY_GROUP_PATH, INIT_GROUP_PATH, AnnouncedBroadcasts,
                                      BeginWeightUpdateBody, DestroyWeightsUpdateGroupBody, EndWeightUpdateBody,
                                      InitWeightsUpdateGroupBody, UpdateWeightsFromDistributedBody,
                                      UpdateWeightsFromTensorBody, UpdateWeightVersionBody, WeightUpdateCommon)
from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest, ServiceError
from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_sidecar.config import SidecarConfig
from node_sidecar.control import ControlPlane
from node_sidecar.control_drain import DrainLimit
from node_sidecar.errors import WeightSyncBroken
from node_sidecar.intent import ClusterIntent
from node_sidecar.node import Node
from node_sidecar.proxy import forward
from node_sidecar.routes_control import answer_by
from node_sidecar.tensor_release import UnreadReleases, payload_fields, release_unread

DISTRIBUTED_PATH = "/update_weights_from_distributed"
TENSOR_PATH = "/update_weights_from_tensor"

log = logging.getLogger(__name__)


def _control_of(request: Request) -> ControlPlane:
    return request.app.state.control


def _node_of(request: Request) -> Node:
    return request.app.state.node


def _releases_of(request: Request) -> UnreadReleases:
    return request.app.state.unread_releases


def weight_router(config: SidecarConfig, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    def update_route(path: str, model: type[WeightUpdateCommon]) -> None:
        async def update(request: Request) -> JSONResponse:
            admin.check(request)
            control = _control_of(request)
            intent = control.node.state.intent
            try:
                body = (await parse_body(request, model)).engine_body(exclude_none=True)
            except InvalidRequest:  # its trainer broadcasts all the same: taken when they can be sized
                announced = _announced(await request.body()) if path == DISTRIBUTED_PATH else None
                if announced is not None and announced["group_name"] not in intent.lost_groups:
                    await _discard_unreceived(control, announced)
                raise
            group = body.get("group_name", DEFAULT_GROUP_NAME)

            async def refuse_a_lost_group() -> None:
                if path == DISTRIBUTED_PATH and group in intent.lost_groups:
                    raise WeightSyncBroken(intent.lost_group_message(group), extra={"group_name": group})

            await refuse_a_lost_group()  # at once, without waiting for the lock; again under it (below): a restart
            # noticed meanwhile (a sync holding the lock) loses the group, and the fresh engine knows no such group
            sent = False

            async def load() -> dict[str, Any]:
                nonlocal sent
                sent = True
                return await control.node.engine_adapter.weight_call(path, body)

            try:
                return JSONResponse(await control.update_weights(
                    load, drain=DrainLimit(config.drain_timeout, answer_by(request)),
                    mode="abort" if body.get("abort_all_requests") else "wait", check=refuse_a_lost_group))
            except ServiceError as exc:
                if path == DISTRIBUTED_PATH and not sent and not isinstance(exc, WeightSyncBroken):
                    await _discard_unreceived(control, body)
                raise

        router.add_api_route(path, update, methods=["POST"], openapi_extra=openapi_body(model),
                             name=path.strip("/"))

    update_route(DISTRIBUTED_PATH, UpdateWeightsFromDistributedBody)

    @router.post(TENSOR_PATH, openapi_extra=openapi_body(UpdateWeightsFromTensorBody), name=TENSOR_PATH.strip("/"))
    async def push_tensors(request: Request) -> JSONResponse:
        """As the other updates; a push refused or cut before the engine read it has the engine read it and load
        nothing (:mod:`node_sidecar.tensor_release`). ``dry_run``: only that read, nothing drained."""
        admin.check(request)
        control = _control_of(request)
        try:
            body = (await parse_body(request, UpdateWeightsFromTensorBody)).engine_body(exclude_none=True)
        except InvalidRequest:
            fields = payload_fields(await request.body())
            if fields is not None:
                await release_unread(control, fields)
            raise
        if body.pop("dry_run"):
            control.node.require_engine()
            return JSONResponse(await control.node.engine_adapter.check_tensor_payload(body))
        sent = False

        async def load() -> dict[str, Any]:
            nonlocal sent
            adapter = control.node.engine_adapter
            sent = True
            return await adapter.weight_call(TENSOR_PATH, body)

        try:
            return JSONResponse(await control.update_weights(
                load, drain=DrainLimit(config.drain_timeout, answer_by(request)),
                mode="abort" if body.get("abort_all_requests") else "wait"))
        except ServiceError:
            if not sent:
                await release_unread(control, body)
            raise
        except asyncio.CancelledError:  # cut (a graceful shutdown past its timeout): read it after this task ends
            if not sent:
                _releases_of(request).schedule(control, body)
            raise

    joins_in_flight: Counter[str] = Counter()  # group name -> init calls through this sidecar not answered yet

    def call_route(path: str, model: type[SGLangRequest], *, serialized: bool) -> None:
        """Checked here, done by the engine; ``serialized``: one at a time with the other control calls (a join
        is not: it waits for the trainer, and a destroy must be able to abandon it)."""
        empty_ok = not any(field.is_required() for field in model.model_fields.values())

        async def call(request: Request) -> JSONResponse:
            admin.check(request)
            body = (await parse_body(request, model, empty_ok=empty_ok)).engine_body()
            control = _control_of(request)
            if serialized:
                return JSONResponse(await control.weight_call(path, body))
            control.node.require_engine()
            intent, group = control.node.state.intent, body.get("group_name", DEFAULT_GROUP_NAME)
            if path == DESTROY_GROUP_PATH and body["abandon_join_only"] and not joins_in_flight[group]:
                # an engine of another kind would destroy a group by that name: the LB's rollback must not
                return JSONResponse({"success": True, "message": f"No join of group {group!r} was "
                                                                 "under way; nothing was destroyed."})
            if path == DESTROY_GROUP_PATH and not body["abandon_join_only"] and group in intent.lost_groups:
                answer = _forget_lost_group(intent, group)
            elif path != INIT_GROUP_PATH:
                answer = await control.node.engine_adapter.weight_call(path, body)
                if path == DESTROY_GROUP_PATH and not body["abandon_join_only"]:
                    intent.record_left(group)
            else:
                joins_in_flight[group] += 1
                try:
                    answer = await control.node.engine_adapter.weight_call(path, body)
                finally:
                    joins_in_flight[group] -= 1
                intent.record_joined(group)
            await control.node.intent_written()
            return JSONResponse(answer)

        router.add_api_route(path, call, methods=["POST"], openapi_extra=openapi_body(model, required=not empty_ok),
                             name=path.strip("/"))

    call_route(INIT_GROUP_PATH, InitWeightsUpdateGroupBody, serialized=False)
    call_route(DESTROY_GROUP_PATH, DestroyWeightsUpdateGroupBody, serialized=False)
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


def _announced(raw: bytes) -> dict[str, Any] | None:
    """The broadcasts a refused ``update_weights_from_distributed`` body announces, read alone; None when they
    cannot be sized (then the engine cannot take them either)."""
    try:
        value = loads_bounded(raw)
        return AnnouncedBroadcasts.model_validate(value).model_dump() if isinstance(value, dict) else None
    except (PeerJSONError, ValidationError):
        return None


async def _discard_unreceived(control: ControlPlane, body: dict[str, Any]) -> None:
    """An ``update_weights_from_distributed`` refused here before its engine saw it (a field refused as read, a
    drain that timed out): the trainer broadcasts whatever the answer, so the engine still takes those broadcasts
    and drops them, and the group stays in step (else the next update would receive these tensors under its own
    names). Best effort (an engine that cannot, vLLM's or SGLang's, leaves it as it was): a failure is logged and
    the refusal stands."""
    try:
        control.node.require_engine()
        await control.node.engine_adapter.discard_broadcasts(body)
    except ServiceError as exc:
        log.warning("the broadcasts of a refused update_weights_from_distributed were not received; group %r is "
                    "out of step with its trainer: %s", str(body.get("group_name"))[:100], str(exc)[:300])


def _forget_lost_group(intent: ClusterIntent, group: str) -> dict[str, object]:
    """A destroy of a group the node lost with its engine: done already (the fresh engine holds no such group)."""
    intent.record_left(group)
    return {"success": True, "message": f"The engine restarted after it joined group {group!r} and holds it no "
                                        "more; nothing was destroyed."}

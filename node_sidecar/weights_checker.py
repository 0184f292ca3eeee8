"""The sidecar's ``GET|POST /weights_checker`` (SGLang's, admin): relayed to a handoff or SGLang engine.

The engine's answer is SGLang's and passed on as it is: ``{"success", "message"}`` (plus ``ranks`` and
``per_engine_checksum`` for a checksum), 200 or 400 (a failed compare names the tensors that differ). Every
action runs under the control lock, one at a time with the other control and weight calls. ``reset_tensors``
overwrites the weights with random values, so it runs like an update: generation is drained first (nothing
drains while generation is paused or the node cannot step), and afterwards the node stops serving (503
``weights_not_loaded``) until an update writes every weight again. Refused (503 ``memory_released``) while the
weights are released: there is nothing to read or write. A vLLM node answers 400 ``unsupported``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from handoff.protocol.engines import EngineKind
from handoff.protocol.errors import NotServingReason
from handoff.protocol.weights import WEIGHTS_CHECKER_PATH, WeightsCheckerBody
from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import NotServing, ServiceError, Unsupported
from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_sidecar.config import SidecarConfig
from node_sidecar.control import ControlPlane
from node_sidecar.control_drain import DrainLimit, Drainer
from node_sidecar.engines.base import EngineAdapter, not_understood
from node_sidecar.engines.sglang import SglangEngine
from node_sidecar.engines.sglang_calls import reached_sglang
from node_sidecar.errors import EngineRefused, EngineUnavailable
from node_sidecar.node import Node
from node_sidecar.routes_control import answer_by
from node_sidecar.state import TagState

RELAYED_KINDS = (EngineKind.HANDOFF, EngineKind.SGLANG)


def weights_checker_router(config: SidecarConfig, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    async def weights_checker(request: Request) -> JSONResponse:
        admin.check(request)
        body = (await parse_body(request, WeightsCheckerBody, empty_ok=True)).engine_body(exclude_none=True)
        control: ControlPlane = request.app.state.control
        status, answer = await check_weights(control, body, DrainLimit(config.drain_timeout, answer_by(request)))
        return JSONResponse(answer, status_code=status)

    for method in ("GET", "POST"):  # one operation id each in the schema
        router.add_api_route(WEIGHTS_CHECKER_PATH, weights_checker, methods=[method],
                             name=f"{method.lower()}_weights_checker",
                             openapi_extra=openapi_body(WeightsCheckerBody, required=False))
    return router


async def check_weights(control: ControlPlane, body: dict[str, Any], drain: DrainLimit) -> tuple[int, dict[str, Any]]:
    """(status, SGLang's answer) of the engine, under the control lock; ``reset_tensors`` drains first."""
    node = control.node
    async with node.control_lock:
        node.require_engine()
        adapter = node.engine_adapter
        if adapter.kind not in RELAYED_KINDS:
            raise Unsupported(f"{WEIGHTS_CHECKER_PATH} is not available for a {adapter.kind.value} engine")
        if node.state.tags["weights"] is not TagState.RESIDENT:
            raise NotServing(f"the weights are {node.state.tags['weights'].value}: resume them before "
                             f"{WEIGHTS_CHECKER_PATH}", NotServingReason.MEMORY_RELEASED)
        if body.get("action") != "reset_tensors" or body.get("selector") == "draft":
            return await _relay(adapter, body)
        state = node.state
        with node.draining(updating_weights=True):
            if not state.is_paused and state.weights_valid and state.is_all_resident:
                await Drainer(node).drain("wait", drain)
            try:
                status, answer = await _relay(adapter, body)
            except ServiceError as exc:  # answered late, by a 5xx, not at all: it may have run all the same
                if not isinstance(exc, EngineUnavailable) or reached_sglang(exc):
                    await _weights_garbage(node, adapter)
                await node.resync_quietly()  # a handoff engine says what it holds
                raise
            # garbage until an update writes every weight again: the node stops serving (SGLang's 400 is a
            # reset that failed part way, some weights random already)
            if status == 200 or isinstance(adapter, SglangEngine):
                await _weights_garbage(node, adapter)
    node.refresh_admission()
    return status, answer


async def _weights_garbage(node: Node, adapter: EngineAdapter) -> None:
    node.state.weights_valid = False
    if isinstance(adapter, SglangEngine):  # SGLang serves whatever its weights hold
        adapter.weights_garbage, adapter.updated_since_garbage = True, False
        await adapter.keep_record()


async def _relay(adapter: EngineAdapter, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The engine's SGLang answer (200 or 400, ``success`` and ``message`` typed) as it is; any other error is
    the engine's own, passed on as every engine error is."""
    response, raw = await adapter.engine.exchange("POST", WEIGHTS_CHECKER_PATH, body)
    try:
        value = loads_bounded(raw) if raw else None
    except PeerJSONError:
        value = None
    status = response.status
    if status in (200, 400) and isinstance(value, dict) and isinstance(value.get("success"), bool) \
            and isinstance(value.get("message"), str) and value["success"] is (status == 200):
        return status, value
    if 200 <= status < 300:
        raise not_understood(adapter.kind.value, WEIGHTS_CHECKER_PATH, "a 2xx that is not SGLang's answer")
    raise EngineRefused(status, value if isinstance(value, dict) else {})

"""The LB's weight and SGLang control routes (admin token; ``?role=``, ``?timeout=`` as for control calls).

Fanned out byte for byte to every node, like the control calls:
``begin_weight_update`` / ``end_weight_update``, ``update_weight_version``,
``weights_checker`` (GET or POST; a node's 400, a failed compare, fails it) and
``abort_request``; ``update_weights_from_distributed`` (every node of the group
receives the same broadcasts) and ``destroy_weights_update_group`` to the nodes
of the group, if it was formed through this LB, else to every node.
``init_weights_update_group`` gives each node its rank offset and rolls back on failure;
``update_weights_from_tensor`` goes to the nodes named by ``?node=``
(:mod:`lb.weight_sync`). Calls that move weights (the group join, tensors,
broadcasts) get ``--weight-sync-timeout`` per node unless ``?timeout=`` says otherwise.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from handoff.protocol.control import AbortBody
from handoff.protocol.weights import DESTROY_GROUP_PATH, INIT_GROUP_PATH, WEIGHT_BODIES, WEIGHT_ROUTES
from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body
from lb.cluster import Cluster
from lb.config import LBConfig
from lb.openapi import CONTROL_PARAMETERS, NODE_PARAMETER
from lb.params import FANOUT_QUERY, role_param
from lb.probes import Probes
from lb.routes_control import FanoutSend, fanned_out, fanout_endpoint
from lb.weight_sync import WeightGroups, WeightSync
from lb.weight_versions import WeightVersions

TENSOR_PATH = "/update_weights_from_tensor"
# the calls that move weights and so may wait on a trainer or a large payload
WEIGHT_MOVING_PATHS = frozenset({INIT_GROUP_PATH, TENSOR_PATH, "/update_weights_from_distributed"})
GROUP_PATHS = ("/update_weights_from_distributed", DESTROY_GROUP_PATH)  # to the nodes of the group they name
FANNED_OUT = [path for path in WEIGHT_BODIES
              if path not in (INIT_GROUP_PATH, TENSOR_PATH, *GROUP_PATHS)] + ["/abort_request"]


def weight_routes(cluster: Cluster, config: LBConfig, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    groups = WeightGroups()  # inits under way and groups formed through this LB (every call shares it)

    def weight_sync() -> WeightSync:
        return WeightSync(cluster.fanout, cluster.membership, cluster.health, groups)

    def route(path: str, send: FanoutSend, parameters: list[dict[str, Any]],
              query: frozenset[str] = FANOUT_QUERY) -> None:
        default_s = config.weight_sync_timeout_s if path in WEIGHT_MOVING_PATHS else None
        model = WEIGHT_BODIES.get(path, AbortBody)
        endpoint = fanout_endpoint(send, admin, config, default_s, query)
        methods = WEIGHT_ROUTES.get(path, ("POST",))
        for method in methods:  # one operation id each in the schema
            router.add_api_route(path, endpoint, methods=[method],
                                 name=path.strip("/") if len(methods) == 1 else f"{method.lower()}_{path.strip('/')}",
                                 openapi_extra={"parameters": parameters, **openapi_body(model, required=False)})

    for path in FANNED_OUT:
        route(path, fanned_out(cluster, path), CONTROL_PARAMETERS)

    async def init(request: Request, body: bytes, timeout_s: float) -> tuple[int, dict[str, Any]]:
        return await weight_sync().init_group(body, role_param(request), timeout_s)

    async def tensors(request: Request, body: bytes, timeout_s: float) -> tuple[int, dict[str, Any]]:
        return await weight_sync().to_nodes(TENSOR_PATH, body, request.headers.get("content-type"),
                                            request.query_params.getlist("node"), timeout_s)

    def to_group(path: str) -> FanoutSend:
        async def send(request: Request, body: bytes, timeout_s: float) -> tuple[int, dict[str, Any]]:
            return await weight_sync().to_group(path, body, request.headers.get("content-type"),
                                                role_param(request), timeout_s)
        return send

    for path in GROUP_PATHS:
        route(path, to_group(path), CONTROL_PARAMETERS)
    route(INIT_GROUP_PATH, init, CONTROL_PARAMETERS)
    route(TENSOR_PATH, tensors, [NODE_PARAMETER, CONTROL_PARAMETERS[1]], frozenset({"node", "timeout"}))

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return await WeightVersions(cluster.membership, cluster.health).weight_versions()

    async def model_info() -> dict[str, Any]:
        return await WeightVersions(cluster.membership, cluster.health).model_info(Probes(cluster))

    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"], name=path.strip("/"))

    return router

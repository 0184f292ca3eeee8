"""The LB's own views and its membership (SPEC section 4): ``/health``, ``/nodes``, ``/memory_occupation``.

``GET /nodes`` lists the members; ``POST /nodes`` (``url``, ``role``,
``bootstrap_port``) adds one and ``DELETE /nodes`` (``?url=`` or a JSON body)
removes one, both with the admin token. A URL is checked on entry
(:class:`lb.config.NodeSpec`): a bad one is 400 naming the problem.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from starlette.responses import JSONResponse

from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest, read_json_object
from lb.cluster import Cluster
from lb.config import NodeSpec, Role
from lb.errors import NodeNotFound
from lb.openapi import DELETE_NODE_PARAMETERS
from lb.params import single_param
from lb.views import cluster_occupation, node_view

__all__ = ["AddNode", "nodes_router"]


class AddNode(BaseModel):
    """``POST /nodes``."""

    model_config = ConfigDict(extra="forbid")

    url: StrictStr
    role: Role = Role.MIXED
    bootstrap_port: StrictInt | None = None


def nodes_router(cluster: Cluster, admin: BearerToken) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        nodes = cluster.membership.nodes()
        return {"status": "ok", "num_nodes": len(nodes), "num_routable": sum(n.is_routable for n in nodes)}

    @router.get("/nodes")
    async def list_nodes() -> JSONResponse:
        # written by json.dumps, not FastAPI's encoder: the views grow with the members (no token asks for them),
        # and the encoder took 5 times as long on the event loop (100 ms for 1024 members)
        return JSONResponse({"nodes": [node_view(node) for node in cluster.membership.nodes()]})

    @router.post("/nodes", status_code=201, openapi_extra=openapi_body(AddNode))
    async def add_node(request: Request) -> dict[str, Any]:
        admin.check(request)  # before the body is read: a caller without the token learns nothing from it
        body = await parse_body(request, AddNode)
        return {"node": node_view(await cluster.add_node(_spec(body.url, body.role, body.bootstrap_port)))}

    @router.delete("/nodes", openapi_extra={"parameters": DELETE_NODE_PARAMETERS})
    async def remove_node(request: Request) -> dict[str, Any]:
        admin.check(request)
        url = single_param(request, "url") or (await read_json_object(request)).get("url")
        if not isinstance(url, str) or not url:
            raise InvalidRequest("give the node as ?url=URL or a JSON body {\"url\": URL}")
        url = _spec(url).url
        node = cluster.membership.same_address(url, learned=False)
        if node is None:
            raise NodeNotFound(f"{url} is not a member", extra={"node": url})
        return {"removed": node_view(cluster.membership.remove(node.url, "removed by DELETE /nodes"))}

    @router.get("/memory_occupation")
    async def memory_occupation() -> dict[str, Any]:
        nodes = cluster.membership.nodes()
        await cluster.health.check_many(nodes)
        return cluster_occupation(nodes)

    return router


def _spec(url: str, role: Role = Role.MIXED, bootstrap_port: int | None = None) -> NodeSpec:
    """The node's spec, its URL checked and normalised; 400 naming what is wrong."""
    try:
        return NodeSpec(url, role, bootstrap_port)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc

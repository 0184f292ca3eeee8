"""The LB's control routes (SPEC section 4): each call fanned out to every node, admin token required.

Every route that fans a call out reads the same way: the admin token, then
``?role=`` and ``?timeout=`` (:mod:`lb.params`), then the whole body, and
answers what the fan-out returns (200 with one result per node, or 502 naming
each node that failed). :func:`fanout_endpoint` is that route, written once;
the weight routes (:mod:`lb.routes_weights`) use it too.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from handoff.protocol.control import CONTROL_ROUTES
from handoff.service.auth import BearerToken
from handoff.service.bodies import openapi_body
from lb.cluster import Cluster
from lb.config import LBConfig
from lb.fanout import default_deadline
from lb.node_answer import dumps_answer
from lb.openapi import CONTROL_BODIES, CONTROL_PARAMETERS, FLUSH_PARAMETERS
from lb.params import FANOUT_QUERY, check_query, role_param, timeout_param
from lb.relay import client_gone_response

__all__ = ["FanoutSend", "control_router", "fanned_out", "fanout_endpoint"]

RELOAD_PATH = "/update_weights_from_disk"
FLUSH_PATH = "/flush_cache"

# what a route does with a checked request: (request, its body, the per-node timeout) -> (status, JSON answer)
FanoutSend = Callable[[Request, bytes, float], Awaitable[tuple[int, dict[str, Any]]]]


def fanout_endpoint(send: FanoutSend, admin: BearerToken, config: LBConfig, default_timeout_s: float | None = None,
                    query: frozenset[str] = FANOUT_QUERY, *,
                    zero_timeout_is_default: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """An admin route that takes the query parameters ``query`` (any other is 400), checks ``?timeout=``
    (``default_timeout_s`` when absent, else ``--control-timeout``; ``0`` too with ``zero_timeout_is_default``;
    when absent, raised to cover the body's ``drain_timeout``: :func:`lb.fanout.default_deadline`),
    reads the body whole and answers what ``send`` returns; a client gone before its body came gets nothing."""
    async def call(request: Request) -> Response:
        admin.check(request)
        check_query(request, query)
        timeout_s = timeout_param(request, config, default_timeout_s, zero_is_default=zero_timeout_is_default)
        try:
            body = await request.body()
        except ClientDisconnect:
            return client_gone_response()
        if "timeout" not in request.query_params:  # a drain the default deadline cannot cover raises it
            timeout_s = default_deadline(request.url.path, body, timeout_s, config.max_control_timeout_s)
        status, payload = await send(request, body, timeout_s)
        return Response(dumps_answer(payload), status_code=status, media_type="application/json")
    return call


def fanned_out(cluster: Cluster, path: str) -> FanoutSend:
    """Send the request's method and body to every node (of ``?role=``) on ``path``."""
    async def send(request: Request, body: bytes, timeout_s: float) -> tuple[int, dict[str, Any]]:
        return await cluster.fanout.run(request.method, path, body, request.headers.get("content-type"),
                                        role_param(request), timeout_s)
    return send


def control_router(cluster: Cluster, config: LBConfig, admin: BearerToken) -> APIRouter:
    """One route per control path and method (one operation id each in the schema)."""
    router = APIRouter()
    for path, methods in CONTROL_ROUTES.items():
        extra: dict[str, Any] = {"parameters": FLUSH_PARAMETERS if path == FLUSH_PATH else CONTROL_PARAMETERS}
        if path in CONTROL_BODIES:
            extra.update(openapi_body(CONTROL_BODIES[path], required=False))
        # a disk reload moves weights as the weight calls do: the engine may read for its --reload-timeout (300 s)
        default_s = config.weight_sync_timeout_s if path == RELOAD_PATH else None
        # SGLang's /flush_cache takes ?timeout= too (seconds to wait for idle, 0 by default): 0 is its default here
        endpoint = fanout_endpoint(fanned_out(cluster, path), admin, config, default_s,
                                   zero_timeout_is_default=path == FLUSH_PATH)
        for method in methods:
            router.add_api_route(path, endpoint, methods=[method], openapi_extra=extra,
                                 name=f"{method.lower()}_{path.strip('/')}")
    return router

"""The sidecar's HTTP app: the node's only door (SPEC section 3).

Generation goes through :class:`~node_sidecar.middleware.GenerationFastPath`
to :func:`~node_sidecar.proxy.relay_generation`; control calls are in
:mod:`node_sidecar.routes_control`, weight calls in :mod:`node_sidecar.routes_weights`,
views and probes in :mod:`node_sidecar.routes_views`.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from handoff import __version__
from handoff.protocol.control import CONTROL_ROUTES
from handoff.protocol.weights import WEIGHT_BODIES, WEIGHT_ROUTES
from handoff.service.auth import BearerToken, admin_token_of
from handoff.service.bodies import install_schemas, openapi_body
from handoff.service.errors import ServiceError, install_error_handlers
from handoff.service.generation_schema import GENERATION_BODIES, GENERATION_RESPONSES
from handoff.service.limits import BodyLimitMiddleware
from handoff.service.status_count import CountByStatus
from handoff.service.unserved import unserved_router
from handoff.service.upstream import UpstreamClient
from node_sidecar.config import SidecarConfig
from node_sidecar.control import ControlPlane
from node_sidecar.control_log import ControlFailureLog
from node_sidecar.loads import loads_router
from node_sidecar.metrics import SidecarMetrics
from node_sidecar.middleware import AsgiHandler, GenerationFastPath, NodeStateHeader
from node_sidecar.node import Node
from node_sidecar.proxy import relay_generation
from node_sidecar.routes_control import CONTROL_BODIES, control_router
from node_sidecar.routes_views import views_router
from node_sidecar.routes_weights import weight_router
from node_sidecar.weights_checker import weights_checker_router
from node_sidecar.tensor_release import UnreadReleases

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def _generation_router(admin: BearerToken, api_key: BearerToken, fast_handlers: dict[str, AsgiHandler]) -> APIRouter:
    """The generation routes (documented in OpenAPI); their fast handlers go into ``fast_handlers``."""
    router = APIRouter()
    for path in GENERATION_PATHS:
        _add_generation_route(router, path, admin, api_key, fast_handlers)
    return router


def _add_generation_route(router: APIRouter, path: str, admin: BearerToken, api_key: BearerToken,
                          fast_handlers: dict[str, AsgiHandler]) -> None:
    route = path.strip("/").replace("/", "_")

    async def handler(request: Request) -> Response:
        api_key.check(request, also=admin)  # the admin token authorizes everything
        return await relay_generation(request.app.state.node, request, path)

    async def fast_handler(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except ServiceError as exc:
            response = exc.to_response()
        await response(scope, receive, send)

    router.add_api_route(path, handler, methods=["POST"], name=route,
                         openapi_extra={**openapi_body(GENERATION_BODIES[path]), **GENERATION_RESPONSES})
    fast_handlers[path] = fast_handler


def _generation_route_of(scope: Scope) -> str | None:
    """The ``route`` label of a generation request (counted by the status its client got), None for others."""
    return _GENERATION_ROUTES.get(scope["path"]) if scope["method"] == "POST" else None


_GENERATION_ROUTES = {path: path.strip("/").replace("/", "_") for path in GENERATION_PATHS}


def create_app(config: SidecarConfig) -> FastAPI:
    metrics = SidecarMetrics()
    admin = BearerToken(admin_token_of(config.admin_token, config.api_key))
    api_key = BearerToken(config.api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = UpstreamClient()
        node = Node(config, client, metrics)
        app.state.node = node
        app.state.control = ControlPlane(node)
        app.state.unread_releases = releases = UnreadReleases()
        node.start()
        try:
            yield
        finally:
            await node.stop()
            await releases.wait()  # pushes cut by the shutdown: their payloads read before the client closes
            await client.aclose()

    app = FastAPI(title="handoff node_sidecar", version=__version__, lifespan=lifespan,
                  description="The node's only door: memory release serialized against generation.")
    fast_handlers: dict[str, AsgiHandler] = {}
    app.add_middleware(GenerationFastPath, handlers=fast_handlers)  # added first: the innermost middleware
    install_error_handlers(app)
    control_paths = frozenset(CONTROL_ROUTES) | frozenset(WEIGHT_ROUTES) | {"/abort_request"}
    app.add_middleware(NodeStateHeader, node=lambda: app.state.node, paths=control_paths)
    app.add_middleware(ControlFailureLog, paths=control_paths)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout)
    app.add_middleware(CountByStatus, counter=metrics.control_calls, route_label="path",
                       route_of=lambda scope: scope["path"].strip("/") if scope["path"] in control_paths else None)
    app.add_middleware(CountByStatus, counter=metrics.requests, route_of=_generation_route_of)  # outermost
    app.include_router(_generation_router(admin, api_key, fast_handlers))
    app.include_router(control_router(config, admin))
    app.include_router(views_router(metrics, admin, api_key))
    app.include_router(loads_router())
    app.include_router(weight_router(config, admin))
    app.include_router(weights_checker_router(config, admin))
    app.include_router(unserved_router(admin))
    install_schemas(app, [*CONTROL_BODIES, *WEIGHT_BODIES.values(), *GENERATION_BODIES.values()])
    return app

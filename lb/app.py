"""The LB's HTTP surface (SPEC section 4): routes, auth, limits, request metrics.

Hot paths take the raw :class:`Request` and forward bytes; pydantic parses only
the bodies the LB itself interprets (``POST /nodes``). The three generation
paths do not go through FastAPI at all (:class:`LBApp`): its router's matching,
exit stacks and dependency solving cost about 70 us of the LB's CPU per request
(0.23 -> 0.15 ms for a PD ``/generate``, bench/lb_bench.py), its outer layers
(error, telemetry and body-limit middleware) about 10 us more, and these paths
need none of it. Their FastAPI routes exist for ``GET /openapi.json`` (every
route of the LB is documented there, bodies from :mod:`lb.openapi`).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from handoff import __version__
from handoff.protocol import errors as E
from handoff.protocol.control import CONTROL_ROUTES
from handoff.service.auth import BearerToken, admin_token_of
from handoff.service.bodies import install_schemas, openapi_body
from handoff.service.errors import ServiceError, UnexpectedErrorMiddleware, install_error_handlers
from handoff.service.generation_schema import GENERATION_RESPONSES
from handoff.service.limits import BodyBudget, BodyLimitMiddleware
from handoff.service.prometheus import shared_exposition
from handoff.service.status_count import CountByStatus
from handoff.service.unserved import unserved_router
from lb.addresses import Resolver
from lb.answer_budget import answer_share
from lb.cluster import Cluster
from lb.config import LBConfig
from lb.metrics import LBMetrics
from lb.openapi import GENERATION_BODIES, SCHEMA_MODELS
from lb.probes import install_probes
from lb.proxy import GENERATION_PATHS
from lb.routes_control import control_router
from lb.routes_nodes import nodes_router
from lb.routes_weights import weight_routes
from lb.workers import workers_router

VIEW_PATHS = ("/health", "/nodes", "/memory_occupation", "/metrics", "/openapi.json")


class GenerationEndpoint:
    """``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``, straight to the proxy. Errors become the
    envelope here, as FastAPI's handlers would make them."""

    def __init__(self, *, handle: Callable[[Request, str], Awaitable[Response]], api_key: BearerToken,
                 admin: BearerToken, answers: BodyBudget) -> None:
        self._handle = handle
        self._api_key = api_key
        self._admin = admin
        self._answers = answers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        # the bytes of a buffered answer are held until its last byte went out: the share ends after the send
        with answer_share(self._answers):
            try:
                if scope["method"] != "POST":
                    raise ServiceError(f"{scope['path']} takes POST", kind=E.METHOD_NOT_ALLOWED,
                                       headers={"Allow": "POST"})
                self._api_key.check(request, also=self._admin)  # the admin token authorizes everything
                response = await self._handle(request, scope["path"])
            except ServiceError as exc:
                response = exc.to_response()
            await response(scope, receive, send)


class LBApp(FastAPI):
    """FastAPI for every route but the generation paths, which go to :attr:`generation`: the same request
    metrics and body limit around a :class:`GenerationEndpoint`, and none of FastAPI's layers."""

    generation: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in GENERATION_PATHS:
            await self.generation(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(config: LBConfig, *, resolver: Resolver | None = None) -> LBApp:
    """The LB as an ASGI app; its cluster starts and stops with the app's lifespan."""
    metrics = LBMetrics()
    cluster = Cluster(config, metrics, resolver=resolver)
    admin = BearerToken(admin_token_of(config.admin_token, config.api_key))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await cluster.start()
        try:
            yield
        finally:
            await cluster.stop()

    app = LBApp(title="handoff lb", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="One URL for the cluster: control calls fanned out to every node, generation "
                              "routed to one.")
    install_error_handlers(app)
    # the last added is the outermost: metrics, then the body limit, then FastAPI's router
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s)
    known_routes = frozenset((*CONTROL_ROUTES, *GENERATION_PATHS, *VIEW_PATHS))

    def route_of(scope: Scope) -> str:
        return scope["path"] if scope["path"] in known_routes else "other"  # bounded labels

    app.add_middleware(CountByStatus, counter=metrics.requests, route_of=route_of)

    async def generate(request: Request, path: str) -> Response:
        return await cluster.proxy.handle(request, path)

    api_key = BearerToken(config.api_key)
    answers = BodyBudget(config.max_buffered_answer_bytes)  # every generation request's buffered answer at once
    endpoint = UnexpectedErrorMiddleware(GenerationEndpoint(handle=generate, api_key=api_key, admin=admin,
                                                            answers=answers))
    app.generation = CountByStatus(BodyLimitMiddleware(endpoint, max_body_bytes=config.max_body_bytes,
                                                       body_timeout_s=config.body_timeout_s),
                                   counter=metrics.requests, route_of=route_of)

    app.include_router(control_router(cluster, config, admin))

    def generation_route(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def generation(request: Request) -> Response:
            """Never reached (:class:`LBApp` sends these paths to its generation endpoint); routes it the same way."""
            api_key.check(request, also=admin)
            return await generate(request, path)
        return generation

    for path in GENERATION_PATHS:  # in the schema; served by LBApp.generation
        app.add_api_route(path, generation_route(path), methods=["POST"],
                          openapi_extra={**openapi_body(GENERATION_BODIES[path]), **GENERATION_RESPONSES})

    app.include_router(nodes_router(cluster, admin))
    app.include_router(weight_routes(cluster, config, admin))
    app.include_router(workers_router(cluster, admin))
    app.include_router(unserved_router(admin))

    exposition = shared_exposition(metrics.registry)  # its series grow with the members: rendered off the loop

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(await exposition(), media_type=CONTENT_TYPE_LATEST)

    install_probes(app, cluster, api_key, admin)
    install_schemas(app, SCHEMA_MODELS)
    return app

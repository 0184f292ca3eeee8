"""The sidecar's HTTP app: the node's only door (SPEC section 3)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

import psutil
from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff import __version__
from handoff.protocol.control import (
    CONTROL_ROUTES,
    DEADLINE_HEADER,
    NODE_STATE_HEADER,
    AbortBody,
    PauseBody,
    ReleaseBody,
    ResumeBody,
    UpdateWeightsFromDiskBody,
)
from handoff.protocol.tags import UnknownTag, parse_tags
from handoff.service.auth import BearerToken
from handoff.service.bodies import install_schemas, openapi_body, parse_body, parse_value
from handoff.service.generation_schema import GENERATION_BODIES, GENERATION_RESPONSES
from handoff.service.errors import InvalidRequest, ServiceError, install_error_handlers, parse_json_bytes
from handoff.service.limits import BodyLimitMiddleware
from handoff.service.upstream import UpstreamClient, UpstreamError
from node_sidecar.config import SidecarConfig
from node_sidecar.control import ControlPlane, DrainLimit
from node_sidecar.errors import EngineUnavailable
from node_sidecar.metrics import SidecarMetrics
from node_sidecar.node import Node
from node_sidecar.proxy import forward, relay_generation
from node_sidecar.state import TAGS, TagState

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")

AsgiHandler = Callable[[Scope, Receive, Send], Awaitable[None]]


class GenerationFastPath:
    """``POST`` to a generation path goes straight to its handler; every other request goes on to ``app``.

    It sits inside the body limit and the unexpected-error middleware, so a
    generation gets the same 413 and 500 answers as before; what it skips is
    FastAPI's routing, dependency solving and exception middleware, a third to
    a half of the sidecar's CPU per proxied request (bench/sidecar_overhead.py).
    The handlers answer :class:`ServiceError` with its envelope themselves. The
    FastAPI routes for these paths stay (OpenAPI, and other methods get their
    405 from there).
    """

    def __init__(self, app: ASGIApp, handlers: dict[str, AsgiHandler]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.app(scope, receive, send)


def answer_by(request: Request) -> float | None:
    """When the caller stops waiting (event-loop time), from :data:`DEADLINE_HEADER`, less a margin for the work
    after the drain and the answer's way back; None without a usable header."""
    try:
        deadline = float(request.headers.get(DEADLINE_HEADER, "nan"))
    except ValueError:
        return None
    if not 0 < deadline < float("inf"):
        return None
    margin = min(max(0.5, 0.1 * deadline), deadline / 2)
    return asyncio.get_running_loop().time() + deadline - margin


class NodeStateHeader:
    """Every answer to a control call (success or error) carries the node's state in :data:`NODE_STATE_HEADER`,
    read when the answer starts, after the call did its work: the LB routes by it without asking again."""

    def __init__(self, app: ASGIApp, node: Callable[[], Node], paths: frozenset[str]) -> None:
        self.app = app
        self._node = node
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self.app(scope, receive, send)
            return

        async def send_with_state(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = self._node().state_header()
                if value is not None:
                    message = {**message, "headers": [*message.get("headers", []), (_STATE_HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_state)


_STATE_HEADER = NODE_STATE_HEADER.encode()


def _tags(names: list[str] | None) -> list[str] | None:
    """Tag names in canonical order; None (all) stays None, ``[]`` is no tag."""
    try:
        tags = parse_tags(names)
    except UnknownTag as exc:
        raise InvalidRequest(str(exc)) from exc
    return None if tags is None else [tag.value for tag in tags]


def create_app(config: SidecarConfig) -> FastAPI:
    metrics = SidecarMetrics()
    admin = BearerToken(config.admin_token)
    api_key = BearerToken(config.api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = UpstreamClient()
        node = Node(config, client, metrics)
        app.state.node = node
        app.state.control = ControlPlane(node)
        node.start()
        try:
            yield
        finally:
            await node.stop()
            await client.aclose()

    app = FastAPI(title="handoff node_sidecar", version=__version__, lifespan=lifespan,
                  description="The node's only door: memory release serialized against generation.")
    fast_handlers: dict[str, AsgiHandler] = {}
    app.add_middleware(GenerationFastPath, handlers=fast_handlers)  # added first: the innermost middleware
    install_error_handlers(app)
    app.add_middleware(NodeStateHeader, node=lambda: app.state.node,
                       paths=frozenset(CONTROL_ROUTES) | {"/abort_request"})
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout)
    router = APIRouter()

    def node_of(request: Request) -> Node:
        return request.app.state.node

    def control_of(request: Request) -> ControlPlane:
        return request.app.state.control

    def drain_limit(request: Request, value: float | None) -> DrainLimit:
        """The body's ``drain_timeout`` (or the default), cut to what the caller's deadline header leaves."""
        if value is not None and value > config.max_drain_timeout:
            raise InvalidRequest(f"drain_timeout must be at most {config.max_drain_timeout:g} s")
        return DrainLimit(config.drain_timeout if value is None else value, answer_by(request))

    # -- generation ------------------------------------------------------------
    def generation_route(path: str) -> None:
        route = path.strip("/").replace("/", "_") or "root"

        def count(code: int) -> None:
            metrics.requests.labels(route, str(code)).inc()

        async def handler(request: Request) -> Response:
            api_key.check(request, also=admin)  # the admin token authorizes everything
            return await relay_generation(node_of(request), request, path, count)

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

    for generation_path in GENERATION_PATHS:
        generation_route(generation_path)

    @router.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        """One-token generation while serving; while not serving, the reason, without touching the engine."""
        api_key.check(request, also=admin)  # the admin token authorizes everything
        node = node_of(request)
        lease = node.admission.try_enter()
        if lease is None:
            released = [t for t in TAGS if node.state.tags[t] is not TagState.RESIDENT]
            status = 503 if not node.state.is_engine_reachable else 200
            return JSONResponse({"serving": False, "reason": node.state.not_serving_reason().value,
                                 "released": released}, status_code=status)
        try:
            answer = await node.engine.call("POST", "/generate", {"input_ids": [0], "sampling_params": {
                "max_new_tokens": 1, "temperature": 0}}, timeout=30)
        finally:
            lease.release()
        return JSONResponse({"serving": True, "success": True, "weight_version": answer["meta_info"]["weight_version"]})

    # -- control -----------------------------------------------------------------
    @router.post("/release_memory_occupation", openapi_extra=openapi_body(ReleaseBody, required=False))
    async def release(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, ReleaseBody, empty_ok=True)
        answer = await control_of(request).release(_tags(body.tags), mode=body.mode,
                                                   drain=drain_limit(request, body.drain_timeout),
                                                   stage_to_cpu=body.stage_to_cpu)
        metrics.control_calls.labels("release_memory_occupation", "200").inc()
        return JSONResponse(answer)

    @router.post("/resume_memory_occupation", openapi_extra=openapi_body(ResumeBody, required=False))
    async def resume(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, ResumeBody, empty_ok=True)
        answer = await control_of(request).resume(_tags(body.tags))
        metrics.control_calls.labels("resume_memory_occupation", "200").inc()
        return JSONResponse(answer)

    @router.post("/update_weights_from_disk", openapi_extra=openapi_body(UpdateWeightsFromDiskBody))
    async def update_weights(request: Request) -> JSONResponse:
        admin.check(request)
        raw = await request.body()
        body = parse_value(parse_json_bytes(raw) if raw.strip() else None, UpdateWeightsFromDiskBody)
        engine_body = body.model_dump(exclude={"drain_timeout", "dry_run"}, exclude_none=True)
        if body.dry_run:  # only the check: nothing drains, nothing loads
            return JSONResponse(await node_of(request).engine.call("POST", "/update_weights_from_disk",
                                                                   {**engine_body, "dry_run": True}))
        answer = await control_of(request).update_weights(engine_body, drain=drain_limit(request, body.drain_timeout))
        metrics.control_calls.labels("update_weights_from_disk", "200").inc()
        return JSONResponse(answer)

    @router.post("/pause_generation", openapi_extra=openapi_body(PauseBody, required=False))
    async def pause_generation(request: Request) -> JSONResponse:
        admin.check(request)
        body = await parse_body(request, PauseBody, empty_ok=True)
        return JSONResponse(await control_of(request).pause(mode=body.mode,
                                                            drain=drain_limit(request, body.drain_timeout)))

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        admin.check(request)
        return JSONResponse(await control_of(request).resume_generation())

    async def flush_cache(request: Request) -> JSONResponse:
        admin.check(request)
        return JSONResponse(await control_of(request).flush_cache())

    for method in ("GET", "POST"):  # one route per method: one operation id each in the schema
        router.add_api_route("/flush_cache", flush_cache, methods=[method], name=f"flush_cache_{method.lower()}")

    @router.post("/abort_request", openapi_extra=openapi_body(AbortBody))
    async def abort_request(request: Request) -> Response:
        admin.check(request)
        return await forward(node_of(request), request, "/abort_request")

    # -- views ---------------------------------------------------------------------
    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(node_of(request), request, "/v1/models")

    @router.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        return await forward(node_of(request), request, "/get_server_info")

    @router.get("/memory_occupation")
    async def memory_occupation(request: Request) -> JSONResponse:
        node = node_of(request)
        engine_view: dict = {}
        if node.state.is_engine_reachable:
            try:
                engine_view = await node.engine.call("GET", "/memory_occupation", timeout=5)
            except EngineUnavailable:
                engine_view = {}
        view = node.state_view()
        engine_tags = engine_view.get("tags")
        if node.state.is_synced and isinstance(engine_tags, dict):
            for tag, row in view["tags"].items():
                engine_row = engine_tags.get(tag)
                if isinstance(engine_row, dict) and isinstance(engine_row.get("bytes"), int):
                    row["bytes"] = engine_row["bytes"]
        view.update(device=engine_view.get("device"), process_rss_bytes=engine_view.get("process_rss_bytes"),
                    sidecar_rss_bytes=psutil.Process().memory_info().rss)
        return JSONResponse(view)

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @router.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        node = node_of(request)
        if node.admission.is_open:
            return JSONResponse({"ready": True})
        return JSONResponse({"ready": False, "reason": node.state.not_serving_reason()}, status_code=503)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics_view(request: Request) -> Response:
        node = node_of(request)
        metrics.inflight_requests.set(node.admission.num_in_flight)
        metrics.held_requests.set(node.admission.num_held)
        text = generate_latest(metrics.registry)
        if node.state.is_engine_reachable:
            try:
                engine = await node.engine.open("GET", "/metrics", timeout=5)
                async with engine:
                    if engine.status == 200:
                        text += await engine.read(8 * 1024 * 1024)
            except (EngineUnavailable, UpstreamError) as exc:  # the node's own metrics still answer
                node.last_error = f"engine /metrics: {exc}"
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.include_router(router)
    install_schemas(app, [ReleaseBody, ResumeBody, PauseBody, UpdateWeightsFromDiskBody, AbortBody,
                          *GENERATION_BODIES.values()])
    return app

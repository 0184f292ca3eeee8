"""The engine's FastAPI app; the engine thread starts and stops with the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from handoff import __version__
from handoff.protocol.control import AbortBody, ReleaseBody, ResumeBody, UpdateWeightsFromDiskBody
from handoff.protocol.weights import WEIGHT_BODIES
from handoff.service.bodies import install_schemas
from handoff.service.disconnect import ClientGone
from handoff.service.errors import install_error_handlers
from handoff.service.limits import BodyLimitMiddleware
from node_engine.engine import Engine
from node_engine.server import openai_bodies, protocol, routes_control, routes_generate, routes_openai, routes_weights
from node_engine.server.generation import longest_token_chars
from node_engine.server.images import ImageLoader


def create_app(engine: Engine, *, max_body_bytes: int, body_timeout_s: float | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        longest_token_chars(engine.tokenizer)  # once, before requests (the prompt length guard needs it)
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="handoff node_engine", version=__version__, lifespan=lifespan,
                  description="LLM engine with releasable, tagged memory regions.")
    app.state.engine = engine
    app.state.images = ImageLoader(engine)
    install_error_handlers(app)
    app.add_exception_handler(ClientGone, _client_gone)  # type: ignore[arg-type]
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.include_router(routes_generate.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_control.router)
    app.include_router(routes_weights.router)
    install_schemas(app, [protocol.GenerateBody, openai_bodies.CompletionBody, openai_bodies.ChatCompletionBody,
                          ReleaseBody, ResumeBody, UpdateWeightsFromDiskBody, AbortBody, *WEIGHT_BODIES.values()])
    return app


async def _client_gone(request: Request, exc: ClientGone) -> Response:
    """The client left while its request was prepared (its images, say): nobody reads the answer."""
    return Response(status_code=routes_generate.CLIENT_CLOSED)

"""A tiny service using the shared plumbing, with routes that fail on purpose (for tests/service)."""

from __future__ import annotations

import argparse

from fastapi import FastAPI, Request

from handoff.service.errors import Conflict, install_error_handlers
from handoff.service.limits import BodyLimitMiddleware
from handoff.service.logs import setup_logging
from handoff.service.serve import add_server_args, serve


def create_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=4096)

    @app.post("/bug")
    async def bug() -> dict:
        raise RuntimeError("a bug")

    @app.post("/bug/{anything:path}")
    async def bug_quoting_the_client(request: Request) -> dict:
        # an exception's message may quote what a client sent
        raise RuntimeError(f"a bug on {(await request.body()).decode('utf-8', 'replace')}")

    @app.post("/conflict")
    async def conflict() -> dict:
        raise Conflict("busy", extra={"in_flight": 3})

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_server_args(parser, default_host="127.0.0.1", default_port=0)
    args = parser.parse_args()
    setup_logging("error_app", fmt=args.log_format, level=args.log_level)
    serve(create_app(), host=args.host, port=args.port, port_file=args.port_file)

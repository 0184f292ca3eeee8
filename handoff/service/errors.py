"""The error envelope every handoff process answers with.

Every error is ``{"error": {"type": ..., "message": ..., **extra}}`` with the
status code SPEC section 6 names. Each service derives its own small exception
tree from :class:`ServiceError`; :func:`install_error_handlers` turns those, and
FastAPI's own validation and routing errors, into the envelope. A user's mistake
never becomes a 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.protocol import errors as E
from handoff.service.logs import rate_limit
from handoff.service.peer_json import PeerJSONError, loads_bounded

log = logging.getLogger(__name__)
rate_limit(log)  # a bug a client can reach is a traceback per request: a burst, then a count

MAX_LOGGED_PATH_CHARS = 200  # a request's path in a log line: past it, cut (a URL has no length limit)


class ServiceError(Exception):
    """An error with a status code and an envelope type.

    Subclasses set ``kind``, an entry of :mod:`handoff.protocol.errors`, which
    gives their ``type`` and ``status``; ``extra`` fields go inside the
    ``error`` object (for example ``in_flight`` on a drain timeout).
    """

    kind: E.ErrorType = E.INTERNAL_ERROR
    status: int = E.INTERNAL_ERROR.status
    type: str = E.INTERNAL_ERROR.name

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            cls.type, cls.status = cls.kind.name, cls.kind.status

    def __init__(
        self,
        message: str,
        *,
        kind: E.ErrorType | None = None,
        status: int | None = None,
        type: str | None = None,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``kind`` (or ``status`` and ``type`` for a peer's own answer passed on) overrides the class's."""
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind, self.status, self.type = kind, kind.status, kind.name
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.type, self.message, **self.extra)

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.envelope(), status_code=self.status, headers=self.headers or None)


class InvalidRequest(ServiceError):
    kind = E.INVALID_REQUEST


class Unauthorized(ServiceError):
    kind = E.UNAUTHORIZED

    def __init__(self, message: str = "missing or wrong bearer token") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class NotFound(ServiceError):
    kind = E.NOT_FOUND


class Conflict(ServiceError):
    kind = E.CONFLICT


class RequestTimeout(ServiceError):
    """The client did not send its request (head or body) in time."""

    kind = E.REQUEST_TIMEOUT


class PayloadTooLarge(ServiceError):
    kind = E.PAYLOAD_TOO_LARGE


class HeadTooLarge(ServiceError):
    """The request line and headers are larger than the server takes (431)."""

    kind = E.HEAD_TOO_LARGE


class Unavailable(ServiceError):
    """503; ``retry_after`` seconds go into a ``Retry-After`` header."""

    kind = E.UNAVAILABLE

    def __init__(self, message: str, *, type: str | None = None, retry_after: float | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
        super().__init__(message, type=type, extra=extra, headers=headers)


class InsufficientMemory(ServiceError):
    kind = E.INSUFFICIENT_MEMORY


class Unsupported(ServiceError):
    """A valid field asks for what this engine cannot do (a LoRA, constrained decoding, ...): never ignored."""

    kind = E.UNSUPPORTED


class NotServing(Unavailable):
    """503 + ``Retry-After`` for generation while a node cannot serve; ``reason`` is the type.

    Nothing ran, so a router may send the request to another node.
    """

    def __init__(self, message: str, reason: E.NotServingReason, *, retry_after: float | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message, type=reason.value, retry_after=retry_after, extra=extra)
        self.reason = reason


def error_envelope(type: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": type, "message": writable(message), **extra}}


def writable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (a file name that is not UTF-8, read with Python's
    ``surrogateescape``) becomes U+FFFD, where the JSON answer naming it could not be encoded (a 500)."""
    return text if text.isascii() else text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def error_response(status: int, type: str, message: str, headers: Mapping[str, str] | None = None,
                   **extra: Any) -> JSONResponse:
    return JSONResponse(error_envelope(type, message, **extra), status_code=status, headers=headers)


_STATUS_TYPES = {
    400: E.INVALID_REQUEST.name,
    401: E.UNAUTHORIZED.name,
    403: "forbidden",
    404: E.NOT_FOUND.name,
    405: E.METHOD_NOT_ALLOWED.name,
    413: E.PAYLOAD_TOO_LARGE.name,
    415: "unsupported_media_type",
    422: E.INVALID_REQUEST.name,
}


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body"


def install_error_handlers(app: FastAPI) -> None:
    """Route every error of ``app`` through the envelope."""

    async def on_service_error(_: Request, exc: ServiceError) -> Response:
        return exc.to_response()

    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(400, E.INVALID_REQUEST.name, _describe_validation(exc))

    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = _STATUS_TYPES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(exc.status_code, type_, message, headers=getattr(exc, "headers", None))

    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_middleware(UnexpectedErrorMiddleware)


class UnexpectedErrorMiddleware:
    """Answer a bug with a logged 500 envelope, and keep the connection.

    Starlette's own handler for ``Exception`` re-raises after answering, which
    makes uvicorn close the connection: a pooled keep-alive client then fails
    its next request on that socket. Here the error stops.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), _shown_path(scope))
            if started:
                raise  # half a response is out: only closing the connection is honest
            response = error_response(500, E.INTERNAL_ERROR.name, f"{type(exc).__name__}: internal error")
            await response(scope, receive, send)


def _shown_path(scope: Scope) -> str:
    path = str(scope.get("path"))
    if len(path) <= MAX_LOGGED_PATH_CHARS:
        return path
    return f"{path[:MAX_LOGGED_PATH_CHARS]}...({len(path)} characters)"


async def read_json_object(request: Request) -> dict[str, Any]:
    """Read a JSON object body; an empty body is ``{}``. Anything else is a 400."""
    raw = await request.body()
    if not raw.strip():
        return {}
    value = parse_json_bytes(raw)
    if not isinstance(value, dict):
        raise InvalidRequest(f"body must be a JSON object, got {type(value).__name__}")
    return value


def parse_json_bytes(raw: bytes) -> Any:
    """Parse a request body; malformed, non-UTF-8 or absurdly nested JSON is a 400."""
    try:
        return loads_bounded(raw)
    except PeerJSONError as exc:
        raise InvalidRequest(f"body: {exc}") from exc

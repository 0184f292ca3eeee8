"""Typed request bodies: parsed by us, described in the served OpenAPI schema.

Handlers read the raw body and call :func:`parse_body`, so every failure
(bad JSON, deep nesting, wrong types, unknown fields) is a 400 with the
envelope, whatever the content type. :func:`openapi_body` documents the model
in the route's OpenAPI entry; :func:`install_schemas` adds the models'
definitions to the app's schema.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError

from handoff.protocol.tags import TagRequest, UnknownTag, parse_tag_request
from handoff.service.errors import InvalidRequest, parse_json_bytes

M = TypeVar("M", bound=BaseModel)

_REF = "#/components/schemas/{model}"


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "body"
        if err.get("type") == "extra_forbidden":
            parts.append(f"{loc}: unknown field")
        else:
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


async def parse_body(request: Request, model: type[M], *, empty_ok: bool = False,
                     before_validation: Callable[[Any], None] | None = None) -> M:
    """The body as ``model``; ``before_validation`` sees the parsed JSON first (to refuse, cheaply, a body whose
    validation would cost too much)."""
    raw = await request.body()
    if not raw.strip():
        if empty_ok:
            return parse_value({}, model)  # a model with required fields still answers 400 naming them
        raise InvalidRequest("request body is empty; a JSON object is required")
    value = parse_json_bytes(raw)
    if before_validation is not None:
        before_validation(value)
    return parse_value(value, model)


def parse_value(value: Any, model: type[M]) -> M:
    if not isinstance(value, dict):
        raise InvalidRequest(f"body must be a JSON object, got {type(value).__name__}")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from exc


def parse_tag_names(names: list[str] | None) -> TagRequest:
    """A body's ``tags`` as SGLang clients name them; an unknown name is a 400."""
    try:
        return parse_tag_request(names)
    except UnknownTag as exc:
        raise InvalidRequest(str(exc)) from exc


def openapi_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {"requestBody": {"required": required, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve ``models`` (and what they reference) under ``components.schemas``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

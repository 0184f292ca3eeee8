"""A chat tool's ``parameters`` as SGLang 0.5.23 checks them (``serving_chat.py`` ``_validate_request``): database
type names rewritten to JSON Schema's (``function_call/utils.py`` ``normalize_json_schema_types``, in place, so
the chat template renders the rewritten schema), then the schema checked against JSON Schema 2020-12's
metaschema; a schema that fails is a 400 naming the tool."""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from handoff.service.errors import InvalidRequest

__all__ = ["check_tool_schemas", "normalize_json_schema_types"]

_STANDARD_TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string", "uuid": "string",
    "date": "string", "datetime": "string", "time": "string", "timestamp": "string", "binary": "string",
    "blob": "string", "bytea": "string", "bytes": "string", "varbinary": "string", "bool": "boolean",
    "bigint": "integer", "smallint": "integer", "tinyint": "integer", "double": "number", "decimal": "number",
    "real": "number", "numeric": "number", "arr": "array", "tuple": "array", "set": "array", "map": "object"}
# a prefix names a type when it is the whole name or a digit, bracket or space follows it ("int32", "list[str]")
_PREFIX_BOUNDARY = frozenset("0123456789[<( \t")
_PREFIX_RULES = ((("int", "uint", "long", "short", "unsigned"), "integer"), (("num", "float"), "number"),
                 (("list",), "array"), (("dict",), "object"))
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties")
MAX_ERROR_CHARS = 300  # the metaschema's message repeats the value it refused, which may be the whole schema


def _normalize_type(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD_TYPES:
        return base
    if base in _TYPE_ALIASES:
        return _TYPE_ALIASES[base]
    for prefixes, target in _PREFIX_RULES:
        if any(base == p or (len(base) > len(p) and base.startswith(p) and base[len(p)] in _PREFIX_BOUNDARY)
               for p in prefixes):
            return target
    return raw


def _unique(items: Iterable[Any]) -> list[Any]:
    """``items`` without repeats, first kept, as SGLang's list scan keeps them, in linear time: hashable items
    (what a JSON type list holds but objects and arrays) by a set, which compares as ``in`` a list does; objects
    and arrays (never valid there) by their JSON. A list scan per item took minutes for 60,000 numbers."""
    kept: list[Any] = []
    seen: set[Any] = set()
    for item in items:
        key = ("json", json.dumps(item, sort_keys=True)) if isinstance(item, (dict, list)) else item
        if key not in seen:
            seen.add(key)
            kept.append(item)
    return kept


def normalize_json_schema_types(schema: Any) -> None:
    """Rewrites, in place, each ``type`` of ``schema`` and its subschemas that names a database type
    (``varchar``, ``int32``, ``decimal(10,2)``) to the JSON Schema type SGLang maps it to; others stay."""
    if isinstance(schema, list):
        for item in schema:
            normalize_json_schema_types(item)
        return
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("type"), str):
        schema["type"] = _normalize_type(schema["type"])
    elif isinstance(schema.get("type"), list):
        schema["type"] = _unique(map(_normalize_type, schema["type"]))
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for value in schema[key].values():
                normalize_json_schema_types(value)
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for value in schema[key]:
                normalize_json_schema_types(value)
    for key in _SCHEMA_VALUES:
        if key in schema:
            normalize_json_schema_types(schema[key])


def check_tool_schemas(tools: Sequence[Any]) -> None:
    """Normalizes and checks each tool's ``function.parameters`` (a :class:`~node_engine.server.openai_tools.Tool`;
    null parameters are left alone), in SGLang's order: the request's tools, then its messages'."""
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters
        if parameters is None:
            continue
        try:
            normalize_json_schema_types(parameters)
            Draft202012Validator.check_schema(parameters)
        except SchemaError as exc:
            raise InvalidRequest(f"Tool {i} function has invalid 'parameters' schema: "
                                 f"{exc.message[:MAX_ERROR_CHARS]}") from None
        except OverflowError as exc:  # a pattern's repetition count past what ``re`` takes, as the regex check meets it
            raise InvalidRequest(f"Tool {i} function has invalid 'parameters' schema: a pattern in it is not a "
                                 f"regular expression: {str(exc)[:MAX_ERROR_CHARS]}") from None
        except RecursionError:
            raise InvalidRequest(f"Tool {i} function 'parameters' schema is too deeply nested or contains a "
                                 "cycle.") from None

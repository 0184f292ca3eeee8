"""What ``GET /openapi.json`` of the LB says about the bodies and parameters it does not parse itself.

The LB forwards generation and control bodies byte for byte, so FastAPI cannot
infer them. The schema documents what a handoff node accepts with the nodes'
own models (:mod:`handoff.protocol.control`); the nodes validate. Generation
bodies: :mod:`handoff.service.generation_schema`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from handoff.protocol.control import CONTROL_BODIES as PROTOCOL_BODIES
from handoff.protocol.weights import WEIGHT_BODIES
from handoff.service.generation_schema import GENERATION_BODIES
from lb.workers import WorkerBody

CONTROL_BODIES: dict[str, type[BaseModel]] = {
    path: model for path, model in PROTOCOL_BODIES.items() if path != "/abort_request"}

__all__ = ["CONTROL_BODIES", "CONTROL_PARAMETERS", "DELETE_NODE_PARAMETERS", "GENERATION_BODIES", "NODE_PARAMETER",
           "SCHEMA_MODELS"]

SCHEMA_MODELS: list[type[BaseModel]] = [*GENERATION_BODIES.values(), *CONTROL_BODIES.values(),
                                        *WEIGHT_BODIES.values(), PROTOCOL_BODIES["/abort_request"], WorkerBody]

CONTROL_PARAMETERS: list[dict[str, Any]] = [
    {"name": "role", "in": "query", "required": False, "description": "only the nodes of this role",
     "schema": {"type": "string", "enum": ["mixed", "prefill", "decode"]}},
    {"name": "timeout", "in": "query", "required": False,
     "description": "seconds each node gets (0 < S <= --max-control-timeout; default --control-timeout)",
     "schema": {"type": "number", "exclusiveMinimum": 0}},
]
# /flush_cache: SGLang's route takes ?timeout= >= 0 (0, its default, flush now): 0 is the LB's default there
FLUSH_PARAMETERS: list[dict[str, Any]] = [
    CONTROL_PARAMETERS[0],
    {"name": "timeout", "in": "query", "required": False,
     "description": "seconds each node gets (0 <= S <= --max-control-timeout; 0 or absent: --control-timeout)",
     "schema": {"type": "number", "minimum": 0}},
]
NODE_PARAMETER: dict[str, Any] = {
    "name": "node", "in": "query", "required": False, "style": "form", "explode": True,
    "description": "a member to send the call to (repeatable; default: every member)",
    "schema": {"type": "array", "items": {"type": "string"}}}
DELETE_NODE_PARAMETERS: list[dict[str, Any]] = [
    {"name": "url", "in": "query", "required": False, "description": "the node to remove (or a body {\"url\"})",
     "schema": {"type": "string"}},
]

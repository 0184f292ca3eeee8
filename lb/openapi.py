"""What ``GET /openapi.json`` of the LB says about the bodies and parameters it does not parse itself.

The LB forwards generation and control bodies byte for byte, so FastAPI cannot
infer them. These models describe what a handoff node accepts (the sidecar and
the engine validate; extra fields are passed on, so they are allowed here) and
are used for the schema only. Generation bodies: :mod:`handoff.service.generation_schema`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from handoff.service.generation_schema import GENERATION_BODIES

_FORWARDED = ConfigDict(extra="allow")


class ReleaseRequest(BaseModel):
    """``tags`` null or absent: all four; ``mode``: ``wait`` drains, ``abort`` ends running requests."""

    model_config = _FORWARDED
    tags: list[Literal["weights", "kv_cache", "cuda_graph", "workspace"]] | None = None
    mode: Literal["wait", "abort"] = "wait"
    drain_timeout: float | None = Field(default=None, gt=0)
    stage_to_cpu: bool | None = None


class ResumeRequest(BaseModel):
    """``tags`` null or absent: every released tag."""

    model_config = _FORWARDED
    tags: list[Literal["weights", "kv_cache", "cuda_graph", "workspace"]] | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = _FORWARDED
    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(default=None, min_length=1)


class PauseRequest(BaseModel):
    model_config = _FORWARDED
    mode: Literal["abort", "wait"] = "abort"
    drain_timeout: float | None = Field(default=None, gt=0)


CONTROL_BODIES: dict[str, type[BaseModel]] = {
    "/release_memory_occupation": ReleaseRequest,
    "/resume_memory_occupation": ResumeRequest,
    "/update_weights_from_disk": UpdateWeightsRequest,
    "/pause_generation": PauseRequest,
}
__all__ = ["CONTROL_BODIES", "CONTROL_PARAMETERS", "DELETE_NODE_PARAMETERS", "GENERATION_BODIES", "SCHEMA_MODELS"]

SCHEMA_MODELS: list[type[BaseModel]] = [*GENERATION_BODIES.values(), *CONTROL_BODIES.values()]

CONTROL_PARAMETERS: list[dict[str, Any]] = [
    {"name": "role", "in": "query", "required": False, "description": "only the nodes of this role",
     "schema": {"type": "string", "enum": ["mixed", "prefill", "decode"]}},
    {"name": "timeout", "in": "query", "required": False,
     "description": "seconds each node gets (0 < S <= --max-control-timeout; default --control-timeout)",
     "schema": {"type": "number", "exclusiveMinimum": 0}},
]
DELETE_NODE_PARAMETERS: list[dict[str, Any]] = [
    {"name": "url", "in": "query", "required": False, "description": "the node to remove (or a body {\"url\"})",
     "schema": {"type": "string"}},
]

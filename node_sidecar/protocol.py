"""Bodies of the sidecar's control calls (strict: wrong types and unknown fields are 400s)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True)


class ReleaseBody(BaseModel):
    """``tags`` null or absent: all four. ``mode``: ``wait`` drains, ``abort`` ends in-flight requests."""

    model_config = _STRICT
    tags: list[str] | None = None
    mode: Literal["wait", "abort"] = "wait"
    drain_timeout: float | None = Field(default=None, gt=0)
    stage_to_cpu: bool | None = None


class ResumeBody(BaseModel):
    """``tags`` null or absent: every released tag."""

    model_config = _STRICT
    tags: list[str] | None = None


class PauseBody(BaseModel):
    model_config = _STRICT
    mode: Literal["abort", "wait"] = "abort"
    drain_timeout: float | None = Field(default=None, gt=0)


class UpdateWeightsBody(BaseModel):
    """Checked here for shape only; the engine validates the checkpoint."""

    model_config = ConfigDict(extra="allow", strict=True)
    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(default=None, min_length=1)
    drain_timeout: float | None = Field(default=None, gt=0)


class AbortBody(BaseModel):
    """``POST /abort_request``: one ``rid`` or ``abort_all: true``. Documented here; the engine validates it."""

    model_config = _STRICT
    rid: str | None = None
    abort_all: bool = False

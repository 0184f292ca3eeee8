"""The error a model folder or config raises when the engine cannot load it (shared with the sidecar)."""

from __future__ import annotations

from handoff.checkpoint.errors import CheckpointError, ModelConfigError

__all__ = ["CheckpointError", "ModelConfigError"]

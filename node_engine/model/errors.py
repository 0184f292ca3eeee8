"""The error a model folder or config raises when the engine cannot load it."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A checkpoint folder or config the engine cannot load; the message names the problem."""

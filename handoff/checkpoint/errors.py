"""The errors of reading a checkpoint folder: both are the caller's mistake (a 400 for a reload)."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A checkpoint folder or config that cannot be loaded; the message names the problem."""


class CheckpointError(ModelConfigError):
    """A checkpoint file that cannot be read as one: the message names the file and why."""

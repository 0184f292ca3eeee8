"""``handoff up``'s model flags, checked before anything starts: a value every engine would refuse at its start
is one line naming the flag (exit 2), not a cluster that launches and then cannot start (exit 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handoff.checkpoint.files import FileReader
from node_engine.model.arch import ModelArch
from node_engine.model.builtin_arch import BUILTIN_PREFIX, builtin_arch


def model_flags_problem(model_path: str, model_override: str | None, engine_kind: str) -> str | None:
    """One line naming ``--model-path`` or ``--model-override`` when the nodes' engine would refuse it, else
    None. Reads only the model folder's ``config.json`` and the names of its weight files (no weights)."""
    overrides: dict[str, Any] = {}
    if model_override is not None:
        parsed = _override_of(model_override, model_path, engine_kind)
        if isinstance(parsed, str):
            return parsed
        overrides = parsed
    if engine_kind != "handoff":  # a vLLM node's folder is ClusterSpec's check; vLLM reads the rest itself
        return None
    if model_path.startswith(BUILTIN_PREFIX):
        return _builtin_problem(model_path, overrides)
    return _folder_problem(Path(model_path))


def _override_of(text: str, model_path: str, engine_kind: str) -> dict[str, Any] | str:
    """The override's fields, or the line saying why it cannot be one."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"--model-override is not valid JSON: {exc}"
    if not isinstance(value, dict):
        return f"--model-override must be a JSON object, got {text[:80]!r}"
    if engine_kind != "handoff":
        return f"--model-override is for handoff's engine (built-in models), not --engine-kind {engine_kind}"
    if not model_path.startswith(BUILTIN_PREFIX):
        return f"--model-override applies to built-in models only, not --model-path {model_path}"
    return value


def _builtin_problem(model_path: str, overrides: dict[str, Any]) -> str | None:
    try:
        builtin_arch(model_path)
    except ValueError as exc:
        return f"--model-path: {exc}"
    try:
        builtin_arch(model_path, overrides)
    except ValueError as exc:
        text = str(exc)
        return text if text.startswith("--model-override") else f"--model-override: {text}"
    return None


def _folder_problem(folder: Path) -> str | None:
    try:
        FileReader().shard_files(folder)
        ModelArch.from_folder(folder)
    except ValueError as exc:  # ModelConfigError, CheckpointError
        return f"--model-path: {exc}"
    except OSError as exc:  # a config.json that cannot be read (permissions, a folder in its place)
        return f"--model-path {folder}: {exc.strerror or exc}"
    return None

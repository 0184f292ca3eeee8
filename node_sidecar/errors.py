"""The sidecar's exception tree (SPEC sections 3 and 6)."""

from __future__ import annotations

from typing import Any

from handoff.service.errors import Conflict, ServiceError, Unavailable


class SidecarError(ServiceError):
    pass


class NotServing(Unavailable):
    """503 for generation while the node cannot serve; ``type`` says why."""


class EngineUnavailable(Unavailable):
    type = "engine_unavailable"


class DrainTimeout(Conflict):
    type = "drain_timeout"


class EngineRefused(ServiceError):
    """The engine answered an error: its status and envelope are passed on unchanged."""

    def __init__(self, status: int, envelope: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        error = envelope.get("error") if isinstance(envelope.get("error"), dict) else {}
        extra = {k: v for k, v in error.items() if k not in ("type", "message")}
        super().__init__(str(error.get("message", f"engine answered {status}")), status=status,
                         type=str(error.get("type", "engine_error")), extra=extra, headers=headers)

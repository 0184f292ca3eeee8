"""The sidecar's exception tree (SPEC sections 3 and 6, types from :mod:`handoff.protocol.errors`)."""

from __future__ import annotations

from typing import Any

from handoff.protocol import errors as E
from handoff.service.errors import Conflict, NotServing, ServiceError, Unavailable

__all__ = ["SidecarError", "NotServing", "EngineUnavailable", "DrainTimeout", "CheckpointTimeout", "EngineRefused",
           "WeightSyncBroken"]


class SidecarError(ServiceError):
    pass


class EngineUnavailable(Unavailable):
    kind = E.ENGINE_UNAVAILABLE


class DrainTimeout(Conflict):
    kind = E.DRAIN_TIMEOUT


class WeightSyncBroken(Conflict):
    """A weight update group that cannot carry updates any more: destroy it and join again."""

    kind = E.WEIGHT_SYNC_BROKEN


class CheckpointTimeout(ServiceError):
    """Reading a checkpoint's headers (the check before a foreign engine's reload) did not finish in time."""

    kind = E.CHECKPOINT_TIMEOUT


class EngineRefused(ServiceError):
    """The engine answered an error: its status and envelope are passed on unchanged."""

    def __init__(self, status: int, envelope: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        error = envelope.get("error") if isinstance(envelope.get("error"), dict) else {}
        extra = {k: v for k, v in error.items() if k not in ("type", "message")}
        super().__init__(str(error.get("message", f"engine answered {status}")), status=status,
                         type=str(error.get("type", "engine_error")), extra=extra, headers=headers)

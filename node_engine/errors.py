"""The engine's exception tree (statuses and types per SPEC sections 5 and 6, from :mod:`handoff.protocol.errors`)."""

from __future__ import annotations

from typing import Any, Mapping

from handoff.protocol import errors as E
from handoff.protocol.errors import NotServingReason
from handoff.service.errors import (
    Conflict,
    InsufficientMemory,
    InvalidRequest,
    NotServing,
    ServiceError,
    Unavailable,
    Unsupported,
)

__all__ = ["EngineError", "InvalidRequest", "Unsupported", "RequestsInFlight", "MemorySaverDisabledError",
           "NoWeightsBackupError", "WeightsNotLoaded", "MemoryReleased", "InsufficientMemory",
           "EngineStopped", "WeightsCorrupted", "BackupFailed", "StepFailed", "CheckpointTimeout", "WeightSyncTimeout",
           "WeightSyncBroken"]


class EngineError(ServiceError):
    pass


class RequestsInFlight(Conflict):
    kind = E.REQUESTS_IN_FLIGHT


class MemorySaverDisabledError(Conflict):
    kind = E.MEMORY_SAVER_DISABLED


class NoWeightsBackupError(Conflict):
    kind = E.NO_WEIGHTS_BACKUP


class WeightsNotLoaded(NotServing):
    """Generation refused: the weights were resumed without a backup and not reloaded since."""

    kind = E.WEIGHTS_NOT_LOADED

    def __init__(self, message: str, *, retry_after: float | None = 1,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message, NotServingReason.WEIGHTS_NOT_LOADED, retry_after=retry_after, extra=extra)


class MemoryReleased(NotServing):
    """Generation refused: a memory tag is released."""

    kind = E.MEMORY_RELEASED

    def __init__(self, message: str, *, retry_after: float | None = 1,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message, NotServingReason.MEMORY_RELEASED, retry_after=retry_after, extra=extra)


class EngineStopped(Unavailable):
    kind = E.ENGINE_STOPPED


class StepFailed(EngineError):
    """A model step raised: the requests in that step failed; the engine goes on."""

    kind = E.ENGINE_FAILED


class WeightsCorrupted(EngineError):
    """A reload failed after it began copying: the node refuses generation until a reload succeeds."""

    kind = E.WEIGHTS_CORRUPTED


class BackupFailed(EngineError):
    """The weights backup could not be written (disk full, bad ``--backup-dir``: the weights stay resident) or
    read back (a file gone or cut short: the weights stay released, the backup kept)."""

    kind = E.BACKUP_FAILED


class CheckpointTimeout(EngineError):
    """A checkpoint read did not finish within ``--reload-timeout``: nothing was loaded."""

    kind = E.CHECKPOINT_TIMEOUT


class WeightSyncTimeout(EngineError):
    """A weight group join or broadcast did not finish within ``--weight-sync-timeout``."""

    kind = E.WEIGHT_SYNC_TIMEOUT


class WeightSyncBroken(Conflict):
    """A weight update group missed a broadcast; it must be destroyed and joined again."""

    kind = E.WEIGHT_SYNC_BROKEN

"""The engine's exception tree (statuses and types per SPEC sections 5 and 6)."""

from __future__ import annotations

from handoff.service.errors import Conflict, InsufficientMemory, InvalidRequest, ServiceError, Unavailable

__all__ = ["EngineError", "InvalidRequest", "RequestsInFlight", "MemorySaverDisabledError", "NoWeightsBackupError",
           "WeightsNotLoaded", "WeightsReleased", "MemoryReleased", "InsufficientMemory", "EngineStopped",
           "WeightsCorrupted", "BackupFailed"]


class EngineError(ServiceError):
    pass


class RequestsInFlight(Conflict):
    type = "requests_in_flight"


class MemorySaverDisabledError(Conflict):
    type = "memory_saver_disabled"


class NoWeightsBackupError(Conflict):
    type = "no_weights_backup"


class WeightsNotLoaded(Conflict):
    type = "weights_not_loaded"


class WeightsReleased(Conflict):
    type = "weights_released"


class MemoryReleased(Unavailable):
    type = "memory_released"


class EngineStopped(Unavailable):
    type = "engine_stopped"


class WeightsCorrupted(ServiceError):
    """A reload failed after it began copying: the node refuses generation until a reload succeeds."""

    status = 500
    type = "weights_corrupted"


class BackupFailed(ServiceError):
    """The weights backup could not be written (disk full, bad ``--backup-dir``): the weights stay resident."""

    status = 507
    type = "backup_failed"

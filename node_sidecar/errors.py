"""The sidecar's exception tree (SPEC sections 3 and 6, types from :mod:`handoff.protocol.errors`)."""

from __future__ import annotations

from typing import Any

from handoff.protocol import errors as E
from handoff.service.errors import Conflict, NotServing, ServiceError, Unavailable

MAX_UNTYPED_MESSAGE_CHARS = 200  # a peer's detail that is not a string, as shown

__all__ = ["SidecarError", "NotServing", "EngineUnavailable", "DrainTimeout", "CheckpointTimeout", "EngineRefused",
           "WeightSyncBroken", "LoadedNotFlushed"]


class SidecarError(ServiceError):
    pass


class EngineUnavailable(Unavailable):
    kind = E.ENGINE_UNAVAILABLE


class DrainTimeout(Conflict):
    kind = E.DRAIN_TIMEOUT


class WeightSyncBroken(Conflict):
    """A weight update group that cannot carry updates any more: destroy it and join again."""

    kind = E.WEIGHT_SYNC_BROKEN


class LoadedNotFlushed(Conflict):
    """A weight update the engine loaded whose prefix-cache flush it refused (requests still running): 409, yet the
    update is done, and ``answer`` (what a success would have answered) is recorded as one (the version, the tags
    woken, the weights' validity: a fresh engine must not serve its start checkpoint for it)."""

    kind = E.REQUESTS_IN_FLIGHT

    def __init__(self, message: str, answer: dict[str, Any]) -> None:
        super().__init__(message, extra={"resumed": answer["resumed"]} if answer.get("resumed") else None)
        self.answer = answer


class CheckpointTimeout(ServiceError):
    """Reading a checkpoint's headers (the check before a foreign engine's reload) did not finish in time."""

    kind = E.CHECKPOINT_TIMEOUT


class EngineRefused(ServiceError):
    """The engine answered an error: its status and envelope are passed on unchanged when it names its type. One
    that names none (SGLang's ``{"error": {"message": ...}}``, FastAPI's 422, a body that is no envelope) takes the
    type of its status from :data:`~handoff.protocol.errors.GENERIC_BY_STATUS` (a 422 a 400), or is a 502
    ``upstream_error`` naming the engine's status: every type answered is one of ``handoff.protocol.errors``'s
    with its own status, or an engine's own."""

    def __init__(self, status: int, envelope: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        error = envelope.get("error") if isinstance(envelope.get("error"), dict) else {}
        extra = {k: v for k, v in error.items() if k not in ("type", "message")}
        message = error.get("message", envelope.get("detail", f"engine answered {status}"))
        message = message if isinstance(message, str) else str(message)[:MAX_UNTYPED_MESSAGE_CHARS]
        kind = error.get("type")
        if not (isinstance(kind, str) and kind):
            generic = E.GENERIC_BY_STATUS.get(status)
            if generic is None:
                generic, message = E.UPSTREAM_ERROR, f"the engine answered {status}: {message}"
            kind, status = generic.name, generic.status
        super().__init__(message, status=status, type=kind, extra=extra, headers=headers)

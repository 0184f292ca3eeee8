"""Every error type a handoff process answers, with its HTTP status (SPEC section 6).

An error answer is ``{"error": {"type": ..., "message": ..., **extra}}``. The
types are grouped by what the caller must do:

- fix the request (4xx): nothing changed, repeating it fails the same way;
- wait and retry (503 with ``Retry-After``, 409 state conflicts): the node is
  busy or not serving; the same call later may succeed;
- look at the nodes (502, 504, 507, 500): something failed on a peer or device.

A process raises the exception classes of :mod:`handoff.service.errors` and of
its own ``errors`` module; each of those names one entry here, so a type has
one status wherever it is answered.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class ErrorType(NamedTuple):
    name: str
    status: int


# -- fix the request -------------------------------------------------------------
INVALID_REQUEST = ErrorType("invalid_request", 400)
UNSUPPORTED = ErrorType("unsupported", 400)          # a valid field asking for what this engine cannot do
UNAUTHORIZED = ErrorType("unauthorized", 401)
NOT_FOUND = ErrorType("not_found", 404)
METHOD_NOT_ALLOWED = ErrorType("method_not_allowed", 405)
REQUEST_TIMEOUT = ErrorType("request_timeout", 408)   # the request's head or body did not arrive in time
PAYLOAD_TOO_LARGE = ErrorType("payload_too_large", 413)
HEAD_TOO_LARGE = ErrorType("head_too_large", 431)  # a request line and headers past the server's bound
HTTP_VERSION_NOT_SUPPORTED = ErrorType("http_version_not_supported", 505)  # HTTP/2.0, 0.9 over HTTP/1
NODE_NOT_FOUND = ErrorType("node_not_found", 404)
NODE_EXISTS = ErrorType("node_exists", 409)

# -- state conflicts: the node is in a state where this call cannot run now ---------
CONFLICT = ErrorType("conflict", 409)
REQUESTS_IN_FLIGHT = ErrorType("requests_in_flight", 409)
DRAIN_TIMEOUT = ErrorType("drain_timeout", 409)
MEMORY_SAVER_DISABLED = ErrorType("memory_saver_disabled", 409)
NO_WEIGHTS_BACKUP = ErrorType("no_weights_backup", 409)
WEIGHT_SYNC_BROKEN = ErrorType("weight_sync_broken", 409)  # a group missed a broadcast: destroy it, init again
TOO_MANY_NODES = ErrorType("too_many_nodes", 409)  # the LB holds --max-nodes members: remove one first

# -- not serving: 503 + Retry-After; nothing ran, so a router may send the request elsewhere --
UNAVAILABLE = ErrorType("unavailable", 503)
OVERLOADED = ErrorType("overloaded", 503)  # the process holds as many request bodies (or connections) as it may
NODE_RELEASED = ErrorType("node_released", 503)
MEMORY_RELEASED = ErrorType("memory_released", 503)
WEIGHTS_NOT_LOADED = ErrorType("weights_not_loaded", 503)
GENERATION_PAUSED = ErrorType("generation_paused", 503)
ENGINE_UNAVAILABLE = ErrorType("engine_unavailable", 503)
ENGINE_STOPPED = ErrorType("engine_stopped", 503)
NO_AVAILABLE_NODE = ErrorType("no_available_node", 503)
NO_NODES = ErrorType("no_nodes", 503)
WEIGHT_VERSION_UNAVAILABLE = ErrorType("weight_version_unavailable", 503)  # a pinned version is not served here
# a restarted engine serves its start checkpoint while the node's weights had been updated: until an update or reload
WEIGHTS_STALE = ErrorType("weights_stale", 503)

# -- something failed on a peer or the device ----------------------------------------
INTERNAL_ERROR = ErrorType("internal_error", 500)
ENGINE_FAILED = ErrorType("engine_failed", 500)        # a model step raised; the request's work is lost
WEIGHTS_CORRUPTED = ErrorType("weights_corrupted", 500)
UPSTREAM_ERROR = ErrorType("upstream_error", 502)
FANOUT_FAILED = ErrorType("fanout_failed", 502)
UPSTREAM_TIMEOUT = ErrorType("upstream_timeout", 504)
CHECKPOINT_TIMEOUT = ErrorType("checkpoint_timeout", 504)    # a checkpoint read did not finish in --reload-timeout
WEIGHT_SYNC_TIMEOUT = ErrorType("weight_sync_timeout", 504)  # a group join or broadcast did not finish in time
INSUFFICIENT_MEMORY = ErrorType("insufficient_memory", 507)
BACKUP_FAILED = ErrorType("backup_failed", 507)

# The type an answer that names none takes for its status (an engine's error body without a ``type``: SGLang's
# ``{"error": {"message": ...}}``, FastAPI's 422 ``{"detail": ...}``); a status not here is a peer's 502.
GENERIC_BY_STATUS: dict[int, ErrorType] = {
    400: INVALID_REQUEST, 401: UNAUTHORIZED, 404: NOT_FOUND, 405: METHOD_NOT_ALLOWED, 408: REQUEST_TIMEOUT,
    409: CONFLICT, 413: PAYLOAD_TOO_LARGE, 422: INVALID_REQUEST, 500: INTERNAL_ERROR, 503: UNAVAILABLE,
    504: UPSTREAM_TIMEOUT, 507: INSUFFICIENT_MEMORY,
}


class NotServingReason(str, enum.Enum):
    """Why a node refuses generation with 503: the request reached no model, so it may go elsewhere.

    The sidecar answers the first four, ``weights_stale`` (its engine restarted
    from its start checkpoint after the node's weights were updated), and
    ``weight_version_unavailable`` for a request pinned to a version it does
    not serve; an engine reached directly
    answers ``memory_released``, ``weights_not_loaded`` or ``engine_stopped``. The
    LB reroutes a generation request that got any of them.
    """

    NODE_RELEASED = NODE_RELEASED.name
    ENGINE_UNAVAILABLE = ENGINE_UNAVAILABLE.name
    WEIGHTS_NOT_LOADED = WEIGHTS_NOT_LOADED.name
    GENERATION_PAUSED = GENERATION_PAUSED.name
    MEMORY_RELEASED = MEMORY_RELEASED.name
    ENGINE_STOPPED = ENGINE_STOPPED.name
    WEIGHT_VERSION_UNAVAILABLE = WEIGHT_VERSION_UNAVAILABLE.name
    WEIGHTS_STALE = WEIGHTS_STALE.name


NOT_SERVING_TYPES: frozenset[str] = frozenset(reason.value for reason in NotServingReason)

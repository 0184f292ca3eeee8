"""Bodies of the control calls (SPEC sections 3 and 5), strict: a wrong type or an unknown field is a 400.

The LB forwards these bodies byte for byte and documents them with these
models; the sidecar parses them and sends the engine the same shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

STRICT = ConfigDict(extra="forbid", strict=True)

# On every answer to a control call a sidecar says where the node stands (the ``GET /memory_occupation`` fields
# that routing needs: serving, admission, tags, weights), as compact JSON, so the LB needs no second request.
NODE_STATE_HEADER = "x-handoff-node-state"
MAX_NODE_STATE_HEADER_BYTES = 4096
# The engine process answering (a fresh value each start of the engine), in handoff's engine's
# ``GET /memory_occupation``: the sidecar tells a restarted engine from one that was unreachable for a while.
ENGINE_INSTANCE = "engine_instance"
# The LB tells a node how long it will wait for this call (seconds, relative): a drain ends in time to answer.
DEADLINE_HEADER = "x-handoff-deadline"

ReleaseMode = Literal["wait", "abort"]
# SGLang's modes (abort, retract, in_place) and handoff's wait (drain, then pause).
PauseMode = Literal["abort", "retract", "in_place", "wait"]
# How SGLang's 2xx /flush_cache answer begins (plain text there, http_server.py:1031: its word that it was idle
# and flushed); the message of every node's flush answer.
FLUSHED = "Cache flushed."
MAX_MODEL_PATH_CHARS = 4096  # PATH_MAX: longer is never a path
MAX_NAME_CHARS = 1024  # a weight group's name, a weight version: past any real one


def peer_weight_version(value: object) -> str | None:
    """A weight version as a peer (an engine) reported it, kept only if a client could have set it (a string of
    1 to :data:`MAX_NAME_CHARS` characters); anything else is no known version. Versions travel in every node's
    state, its state header and each answer's ``meta_info``: an unbounded one would outgrow them."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS else None


class SGLangRequest(BaseModel):
    """A body modelled on one of SGLang 0.5.23's request structs. Each of those is a ``BaseReq`` and takes its
    ``rid`` and ``http_worker_ipc`` (a serialized struct carries them, often null): accepted, and ignored
    here as SGLang ignores them on these calls."""

    model_config = STRICT
    rid: str | None = None
    http_worker_ipc: str | None = None

    def engine_body(self, *, exclude: frozenset[str] = frozenset(), exclude_none: bool = False) -> dict[str, Any]:
        """The fields passed on to an engine: all but ``exclude``; ``rid`` and ``http_worker_ipc`` stay here."""
        return self.model_dump(exclude=set(exclude) | {"rid", "http_worker_ipc"}, exclude_none=exclude_none)


class ReleaseBody(SGLangRequest):
    """``POST /release_memory_occupation``.

    ``tags``: null or absent means all four, ``[]`` means none (a no-op).
    ``mode``: ``wait`` drains in-flight generation (at most ``drain_timeout``
    seconds), ``abort`` ends it at once. ``stage_to_cpu`` asks for the weights
    backup configured at start.
    """

    model_config = STRICT
    tags: list[str] | None = None
    mode: ReleaseMode = "wait"
    drain_timeout: float | None = Field(default=None, gt=0)
    stage_to_cpu: bool | None = None


class ResumeBody(SGLangRequest):
    """``POST /resume_memory_occupation``: ``tags`` null or absent means every released tag, ``[]`` none."""

    model_config = STRICT
    tags: list[str] | None = None


class PauseBody(SGLangRequest):
    """``POST /pause_generation`` (SGLang's ``PauseGenerationReqInput`` plus ``wait``).

    ``abort`` ends running requests; ``retract`` sends them back to the queue (their
    KV freed, recomputed after ``continue_generation``); ``in_place`` keeps them and
    their KV, not stepping; ``wait`` lets them finish first. New requests are held
    until ``continue_generation``.
    """

    model_config = STRICT
    mode: PauseMode = "abort"
    drain_timeout: float | None = Field(default=None, gt=0)


class ContinueBody(SGLangRequest):
    """``POST /continue_generation``: SGLang's ``torch_empty_cache`` (return cached device blocks first)."""

    model_config = STRICT
    torch_empty_cache: bool = True


class UpdateWeightsFromDiskBody(SGLangRequest):
    """``POST /update_weights_from_disk``: SGLang 0.5.23's ``UpdateWeightFromDiskReqInput``.

    ``abort_all_requests`` aborts running generation instead of waiting for it;
    ``flush_cache`` (default true) drops cached prefixes the old weights computed;
    ``keep_pause`` is accepted and changes nothing, as in SGLang 0.5.23 (an update never lifts a pause);
    ``torch_empty_cache`` returns freed device or heap memory; ``token_step`` is
    recorded with the version. ``is_async`` and ``recapture_cuda_graph`` are
    accepted as SGLang does: the answer comes once the weights are loaded, and
    captured graphs stay valid because weights are copied in place.
    ``manifest`` is accepted and unused (as in SGLang 0.5.23).
    ``drain_timeout`` is the sidecar's; ``dry_run`` (the sidecar to its engine)
    checks the checkpoint without loading it.
    """

    model_config = STRICT
    model_path: str = Field(min_length=1, max_length=MAX_MODEL_PATH_CHARS)
    load_format: str | None = None

    @field_validator("model_path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("a path cannot hold a NUL character")
        return value
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = Field(default=0, ge=0, le=2**63 - 1)  # at most an int64
    flush_cache: bool = True
    manifest: dict[str, object] | None = None
    drain_timeout: float | None = Field(default=None, gt=0)
    dry_run: bool = False


class AbortBody(BaseModel):
    """``POST /abort_request``: SGLang's ``AbortReq``.

    ``abort_all: true`` aborts everything (``rid`` is then ignored, verl sends
    ``""``); otherwise ``rid`` names one request, and an unknown or empty rid is a
    no-op, as in SGLang.
    """

    model_config = STRICT
    rid: str | None = ""  # SGLang's BaseReq.rid is Optional; a serialized AbortReq sends null
    abort_all: bool = False
    # The rest of SGLang 0.5.23's AbortReq (a BaseReq): its HTTP handler reads only rid and abort_all, so these are
    # accepted and ignored there, and here (a serialized AbortReq carries them, often null).
    http_worker_ipc: str | None = None
    abort_message: str | None = None
    finished_reason: dict[str, str | int | list[int] | None] | None = None
    weight_versions: list[Any] | None = None

    @field_validator("rid")
    @classmethod
    def _null_is_empty(cls, value: str | None) -> str:
        return value or ""


# The calls the LB sends to every node (SPEC section 4), with their methods. A sidecar answers each with
# NODE_STATE_HEADER; a call that may change whether a node serves is in STATE_CHANGING_PATHS, and one during
# which the LB routes no generation to the node in FENCING_PATHS.
CONTROL_ROUTES: dict[str, tuple[str, ...]] = {
    "/release_memory_occupation": ("POST",),
    "/resume_memory_occupation": ("POST",),
    "/flush_cache": ("GET", "POST"),
    "/update_weights_from_disk": ("POST",),
    "/pause_generation": ("POST",),
    "/continue_generation": ("POST",),
}
FENCING_PATHS = frozenset({"/release_memory_occupation", "/pause_generation"})
STATE_CHANGING_PATHS = frozenset(CONTROL_ROUTES) - {"/flush_cache"}
# Calls whose body may carry a drain_timeout that must fit in the LB's per-node deadline.
DRAINING_PATHS = frozenset({"/release_memory_occupation", "/pause_generation", "/update_weights_from_disk"})

CONTROL_BODIES: dict[str, type[BaseModel]] = {
    "/release_memory_occupation": ReleaseBody,
    "/resume_memory_occupation": ResumeBody,
    "/update_weights_from_disk": UpdateWeightsFromDiskBody,
    "/pause_generation": PauseBody,
    "/continue_generation": ContinueBody,
    "/abort_request": AbortBody,
}

"""Bodies of the weight calls (SGLang 0.5.23's ``io_struct``), strict: a wrong type or an unknown field is a 400.

Weight sync without disk: ``update_weights_from_tensor`` (serialized tensors
of a process on the same host), a torch.distributed group with the trainer
(``init_weights_update_group``, ``update_weights_from_distributed``,
``destroy_weights_update_group``), SGLang's update session
(``begin_weight_update`` / ``end_weight_update``), and the served version
(``update_weight_version``), and SGLang's ``weights_checker`` (snapshot, reset, compare,
checksum of the weights; :mod:`node_engine.weights_checker`). The sidecar and the engine parse these; the LB
parses the group bodies (it gives each node its ranks) and documents the rest.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from handoff.protocol.control import MAX_NAME_CHARS, STRICT, SGLangRequest, peer_weight_version
from handoff.protocol.hosts import canonical_host

DEFAULT_GROUP_NAME = "weight_update_group"
MAX_TENSORS_PER_UPDATE = 100_000
MAX_TENSOR_RANK = 8
MAX_ELEMENTS = 1 << 48  # per tensor: past any real one, and within torch's int64 sizes
# Ranks in a weight group: past any RL deployment's. gloo's full mesh takes about 1.4 KiB per rank in every joining
# process before any peer answers (1.4 GB at 10^6 ranks), so torch's own bound (C ints) let one call exhaust memory.
MAX_WORLD_SIZE = 1 << 16
MAX_TP_SIZE = 1024  # a peer's tensor-parallel size: past it, not one (a node's ranks in a group)
MAX_TENSOR_PAYLOADS = 64  # serialized_named_tensors: one per tensor-parallel rank
MAX_SKIP_PATTERNS = 10_000  # a weights_checker's skip_tensor_list: past any model's tensor count
Selector = Literal["target", "draft", "all"]
TensorLoadFormat = Literal["direct", "flattened_bucket"]
GroupBackend = Literal["gloo", "nccl"]

# torch dtype names a weight may arrive in (SGLang sends ``str(dtype)`` without ``torch.``).
WEIGHT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
# Every torch dtype a broadcast may be announced in, by its name in ``torch`` (SGLang's ``getattr(torch, dtype)``
# takes any of them, its aliases too): a receiver can size the broadcasts of all of these, so an update announcing
# one that is no weight's is received and refused, never left unreceived (its trainer blocked in its broadcast).
_TORCH_DTYPES: tuple[str, ...] = (*WEIGHT_DTYPES, "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                  "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                                  "float8_e4m3fnuz", "float8_e5m2fnuz")
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "short": "int16", "int": "int32",
                  "long": "int64", "cfloat": "complex64", "cdouble": "complex128"}


class WeightUpdateCommon(SGLangRequest):
    """Fields every weight update shares (SGLang's meaning)."""

    model_config = STRICT
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    selector: Selector = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromTensorBody(WeightUpdateCommon):
    """``POST /update_weights_from_tensor``.

    ``serialized_named_tensors``: one base64 string per tensor-parallel rank (1 for
    this engine), each SGLang's ``MultiprocessingSerializer`` output: a list of
    ``(name, tensor)`` pairs (``load_format`` null or ``direct``) or a flattened
    bucket (``flattened_bucket``). The tensors travel as torch's shared-memory (CPU)
    or CUDA IPC handles, so the sender must be on the node's host.
    """

    serialized_named_tensors: list[str] = Field(min_length=1, max_length=MAX_TENSOR_PAYLOADS)
    load_format: TensorLoadFormat | None = None
    # handoff's: torch counts one reader per serialized CPU tensor. The LB, sending one payload to several
    # engines, sets this false on all but one of them, so the sender's shared memory is released exactly once.
    release_sender_reference: bool = True
    # handoff's: read and check the payload, load nothing. Reading it releases the sender's reference as a load
    # would, so a sidecar that refuses a push (a drain that timed out, a bad field) has its engine read it this way.
    dry_run: bool = False


class AnnouncedBroadcasts(BaseModel):
    """What an ``update_weights_from_distributed`` body announces its trainer broadcasts, read alone (its other
    fields ignored): a receiver that refuses the body still takes these, so the trainer is not left blocked and the
    group stays in step. A name listed twice is the receiver's to refuse, after receiving (SGLang takes both)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    names: list[str] = Field(min_length=1, max_length=MAX_TENSORS_PER_UPDATE)
    dtypes: list[str] = Field(min_length=1, max_length=MAX_TENSORS_PER_UPDATE)
    shapes: list[list[int]] = Field(min_length=1, max_length=MAX_TENSORS_PER_UPDATE)
    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1, max_length=MAX_NAME_CHARS)
    # SGLang receives one broadcast per tensor for anything but flattened_bucket ("direct" is its tensor path's name)
    load_format: Literal["direct", "flattened_bucket"] | None = None

    @field_validator("dtypes")
    @classmethod
    def _known_dtypes(cls, dtypes: list[str]) -> list[str]:
        names = [_DTYPE_ALIASES.get(d, d) for d in (d.removeprefix("torch.") for d in dtypes)]
        unknown = sorted({d[:40] for d in names if d not in _TORCH_DTYPES})
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown[:8]}; weights are one of {list(WEIGHT_DTYPES)}")
        return names

    @field_validator("shapes")
    @classmethod
    def _sane_shapes(cls, shapes: list[list[int]]) -> list[list[int]]:
        for shape in shapes:
            if (len(shape) > MAX_TENSOR_RANK or any(not 0 <= dim < MAX_ELEMENTS for dim in shape)
                    or math.prod(shape) >= MAX_ELEMENTS):
                raise ValueError(f"shape {shape[:MAX_TENSOR_RANK + 1]} is not a tensor shape (at most "
                                 f"{MAX_TENSOR_RANK} dimensions, fewer than 2^48 elements)")
        return shapes

    @model_validator(mode="after")
    def _same_lengths(self) -> "AnnouncedBroadcasts":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor "
                             f"(got {len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})")
        return self


class UpdateWeightsFromDistributedBody(WeightUpdateCommon, AnnouncedBroadcasts):
    """``POST /update_weights_from_distributed``: one broadcast from rank 0 per listed tensor, in order
    (``load_format: flattened_bucket``: one broadcast of all of them, packed)."""

    model_config = STRICT


class InitWeightsUpdateGroupBody(SGLangRequest):
    """``POST /init_weights_update_group``: join the trainer's group (rank 0 hosts its TCP store).

    ``master_port`` may be a string of digits (AReaL sends one). Through the LB,
    ``rank_offset`` is the first engine rank and ``world_size`` the whole group;
    the LB gives each node its own offset.
    """

    model_config = STRICT
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, lt=MAX_WORLD_SIZE)
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1, max_length=MAX_NAME_CHARS)
    backend: GroupBackend = "nccl"
    # AReaL 1.0.4 adds the pipeline stage of a per-stage group (``pp_rank``) when its servers run PP > 1. SGLang
    # 0.5.23's struct has no such field and its HTTP layer drops unknown fields, so the join is the same with or
    # without it: accepted, checked, and not passed on (see :meth:`engine_body`).
    pp_rank: int | None = Field(default=None, ge=0, lt=MAX_WORLD_SIZE)

    def engine_body(self, *, exclude: frozenset[str] = frozenset(), exclude_none: bool = False) -> dict[str, object]:
        return super().engine_body(exclude=exclude | {"pp_rank"}, exclude_none=exclude_none)

    @field_validator("master_address")
    @classmethod
    def _host(cls, value: str) -> str:
        """A host name, an IPv4 address, or an IPv6 address (bracketed or not): what ``tcp://host:port`` holds."""
        try:
            canonical_host(value)
        except ValueError as exc:
            raise ValueError(f"master_address {value[:80]!r}: {exc}") from None
        return value

    @field_validator("master_port", mode="before")
    @classmethod
    def _port_digits(cls, value: object) -> object:
        if isinstance(value, str) and value.isascii() and value.isdigit():
            return int(value)
        return value

    @model_validator(mode="after")
    def _rank_in_group(self) -> "InitWeightsUpdateGroupBody":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside a group of world_size {self.world_size}")
        return self


class DestroyWeightsUpdateGroupBody(SGLangRequest):
    """``POST /destroy_weights_update_group``.

    ``abandon_join_only`` (handoff's, what the LB's rollback sends to a node whose
    join had not answered yet): abandon a join of ``group_name`` under way, and
    leave a group already joined alone (another init's, which a duplicate init
    must not tear down); with no join under way it does nothing.
    """

    model_config = STRICT
    group_name: str = Field(default=DEFAULT_GROUP_NAME, min_length=1, max_length=MAX_NAME_CHARS)
    abandon_join_only: bool = False


class BeginWeightUpdateBody(SGLangRequest):
    """``POST /begin_weight_update``: open SGLang's update session (one at a time)."""

    model_config = STRICT
    selector: Selector = "all"


class EndWeightUpdateBody(SGLangRequest):
    """``POST /end_weight_update``: close the session."""

    model_config = STRICT


class UpdateWeightVersionBody(SGLangRequest):
    """``POST /update_weight_version``: set the served version (``abort_all_requests`` defaults to true)."""

    model_config = STRICT
    new_version: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    abort_all_requests: bool = True


class WeightsCheckerBody(SGLangRequest):
    """``GET|POST /weights_checker`` (SGLang's ``CheckWeightsReqInput``; the body is optional). ``action``:
    ``checksum`` (default), ``snapshot``, ``reset_tensors`` or ``compare``; any other string is the engine's 400
    (``Unsupported action=...``), as in SGLang. ``skip_tensor_list``: substrings of tensor names left out of
    reset, compare and checksum. ``allow_quant_error`` is taken and has no effect (no quantized weights here)."""

    model_config = STRICT
    action: str = Field(default="checksum", max_length=MAX_NAME_CHARS)
    allow_quant_error: bool = False
    skip_tensor_list: list[Annotated[str, Field(max_length=MAX_NAME_CHARS)]] | None = Field(
        default=None, max_length=MAX_SKIP_PATTERNS)
    selector: Selector = "all"


INIT_GROUP_PATH = "/init_weights_update_group"
WEIGHTS_CHECKER_PATH = "/weights_checker"
WEIGHTS_CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
# A field no weight body takes, added by a sidecar that refused an ``update_weights_from_distributed`` before its
# engine saw it: the engine refuses the body as read (never loads it) and still takes the broadcasts it announces.
REFUSED_UPSTREAM_FIELD = "refused_by_sidecar"
DESTROY_GROUP_PATH = "/destroy_weights_update_group"

WEIGHT_BODIES: dict[str, type[BaseModel]] = {
    "/update_weights_from_tensor": UpdateWeightsFromTensorBody,
    INIT_GROUP_PATH: InitWeightsUpdateGroupBody,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedBody,
    DESTROY_GROUP_PATH: DestroyWeightsUpdateGroupBody,
    "/begin_weight_update": BeginWeightUpdateBody,
    "/end_weight_update": EndWeightUpdateBody,
    "/update_weight_version": UpdateWeightVersionBody,
    WEIGHTS_CHECKER_PATH: WeightsCheckerBody,
}

# The weight calls the LB sends to every node (or, for tensors, to the nodes the caller names), with their methods;
# each may change what a node serves, so a sidecar answers each with its state (NODE_STATE_HEADER).
# (SGLang's /weights_checker takes GET as well)
WEIGHT_ROUTES: dict[str, tuple[str, ...]] = {path: ("GET", "POST") if path == WEIGHTS_CHECKER_PATH else ("POST",)
                                             for path in WEIGHT_BODIES}

# The header a generation request pins a weight version with: only nodes serving that version take it.
WEIGHT_VERSION_HEADER = "x-weight-version"


def pinned_version(value: str) -> str | None:
    """The version a request pins: its :data:`WEIGHT_VERSION_HEADER` as servers decode a header (Latin-1, byte for
    byte) read as UTF-8, as a client writes a non-ASCII version set in JSON; None when that is no version
    (not UTF-8, or not 1 to :data:`MAX_NAME_CHARS` characters)."""
    try:
        return peer_weight_version(value.encode("latin-1").decode("utf-8"))
    except UnicodeError:
        return None


# In handoff's engine's answer to every weight update (disk, tensor, broadcast): whether updates since the engine
# process started have written every weight of its model (a reload writes all, a bucket its names). A sidecar lifts
# ``weights_stale`` from a restarted engine only when it is true; an answer without it (vLLM, SGLang) lifts it as any
# successful update does.
WEIGHTS_UPDATED_FULLY = "weights_updated_fully"

# In handoff's engine's ``GET /memory_occupation``: whether an update since the engine process started wrote any of
# its weights (it serves something other than its start checkpoint). A sidecar that lost its own record of the
# update (its state file's write failed, it was killed mid-update) learns it from the engine, so that a later fresh
# engine is held out with ``weights_stale``.
WEIGHTS_UPDATED = "weights_updated"

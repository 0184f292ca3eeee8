"""The interface between the sidecar and the engine behind it.

The sidecar keeps one state machine, one admission, one drain and one set of
SPEC answers for every kind of engine; an :class:`EngineAdapter` is the only
part that knows how a given engine is called and how its state is read. Its
rules:

- It says which of the four SPEC tags exist in its engine and what each means
  (:attr:`EngineAdapter.tag_meanings`); a tag with no region of its own is
  tracked by the sidecar alone and frees nothing.
- It is called under the node's control lock, after the sidecar drained (or
  aborted) generation: an adapter never waits for requests itself, and never
  sends an engine a call the engine would answer by dying or by blocking.
- It reports what it measured and how (:class:`MemoryChange`), never a figure
  it assumed.
- Errors: :class:`~node_sidecar.errors.EngineUnavailable` when the engine
  cannot be reached, :class:`~node_sidecar.errors.EngineRefused` (its status
  and message) when it refuses, and a SPEC error (``unsupported``,
  ``requests_in_flight``) when the adapter refuses before calling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from handoff.protocol import errors as E
from handoff.protocol.control import peer_weight_version
from handoff.protocol.engines import EngineKind
from handoff.protocol.tags import TAG_NAMES, TagState
from handoff.service.errors import Unsupported
from handoff.service.relay import ChunkTransform
from node_sidecar.engine_client import EngineClient
from node_sidecar.errors import EngineRefused

HEALTH_GENERATE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TagMeaning:
    """What one SPEC tag is in an engine: the engine's own name for the region (None: the engine has no such
    region; the sidecar tracks the tag's state and frees nothing), and one line saying what happens to it."""

    engine_tag: str | None
    meaning: str


@dataclass(frozen=True)
class EngineView:
    """The node's state as read from the engine (at start, and again whenever the engine comes back)."""

    tags: dict[str, TagState]
    weights_valid: bool
    weight_version: str | None = None
    weights_backup: str = "none"       # what a release without stage_to_cpu does with the weights
    memory_saver: str = "off"          # "off": release and resume answer 409 memory_saver_disabled
    can_stage_weights: bool = False    # whether stage_to_cpu: true can be honoured
    tag_bytes: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TAG_NAMES})
    paused: bool = False               # requests paused in the engine (SGLang's retract / in_place) wait
    tp_size: int = 1                   # the ranks the engine takes in a weight update group (one per TP rank)
    control_calls_pending: int = 0     # calls the engine has not finished: what they change is not in the view
    instance: str | None = None        # the engine process (another value: a restarted engine); None: not told
    weights_updated: bool = False      # the engine says an update since it started wrote weights (False: not told)
    reports_tags: bool = False         # ``tags`` are the engine's own account, not the adapter's memory of its calls
    unknown: frozenset[str] = frozenset()  # tags (in ``tags`` as released) whose state is not known: no call
    # may touch them (a memory call a sidecar before this one sent and did not see end)
    unknown_reason: str | None = None  # why, and the way out


@dataclass(frozen=True)
class MemoryChange:
    """What a release or a resume did: the SPEC tags it moved, the bytes by tag (or by group of tags the engine
    frees together, named ``"weights+kv_cache"``), how those bytes were measured (``engine``: the engine's own
    per-tag figures; ``process_rss``: the engine processes' resident set; ``device_used``: the engine processes'
    device memory; None: not measurable here, and ``bytes`` is empty), and whether the weights are valid after."""

    tags: list[str]
    bytes: dict[str, int]
    measured_by: str | None
    weights_valid: bool | None = None


@dataclass(frozen=True)
class GenerationCall:
    """Where a generation request goes in the engine and how its answer comes back: ``answer`` rewrites a
    whole (non-stream, 2xx) answer, ``stream`` makes the transform of a streamed one; None passes it as is."""

    path: str
    body: bytes
    answer: Callable[[bytes], bytes] | None = None
    stream: Callable[[], ChunkTransform] | None = None


class EngineAdapter(ABC):
    """One kind of engine behind the sidecar. Subclasses fill in every abstract method; see the module rules."""

    kind: ClassVar[EngineKind]
    tag_meanings: ClassVar[Mapping[str, TagMeaning]]
    health_path: ClassVar[str] = "/health"   # a cheap liveness check that never generates
    screens_media: ClassVar[bool] = False    # the sidecar screens media items for it (node_sidecar/media.py)

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    # -- state ---------------------------------------------------------------------
    @abstractmethod
    async def read_view(self) -> EngineView:
        """The engine's state now; raises EngineUnavailable (with a reason) if it cannot be read."""

    async def memory_view(self) -> dict[str, Any]:
        """Extra figures for ``GET /memory_occupation``: ``tags`` (bytes per tag), ``device``,
        ``process_rss_bytes``; what the engine cannot tell is left out."""
        return {}

    # -- memory --------------------------------------------------------------------
    def release_set(self, asked: list[str], resident: list[str]) -> list[str]:
        """The tags a release of ``asked`` (all resident) really releases; an engine that frees some regions
        only together adds the resident ones that go with them. Canonical order."""
        return asked

    @abstractmethod
    async def release(self, tags: list[str], *, stage_to_cpu: bool | None) -> MemoryChange:
        """Release ``tags`` (resident, non-empty, from :meth:`release_set`); generation is drained."""

    @abstractmethod
    async def resume(self, tags: list[str]) -> MemoryChange:
        """Resume ``tags`` (released, non-empty)."""

    # -- generation and requests -----------------------------------------------------
    def generation_call(self, path: str, body: bytes, query: str) -> GenerationCall:
        """How a generation request to ``path`` reaches the engine (raise InvalidRequest / Unsupported for a
        body the engine cannot serve: that is answered before the request is admitted)."""
        return GenerationCall(f"{path}?{query}" if query else path, body)

    async def requests_running(self) -> int | None:
        """The generation requests the engine itself runs or queues now (None: it does not say). One whose client
        left (or whose deadline passed) is out of the sidecar's count at once but runs there until the engine sees
        its connection closed: a drain waits for this to be 0 as well."""
        return None

    @abstractmethod
    async def abort(self, *, rid: str | None, abort_all: bool) -> dict[str, Any]:
        """End one request (by its ``rid``) or every request now; they finish with their tokens so far."""

    async def health_generate(self, timeout: float) -> str | None:
        """Generate one token within ``timeout`` seconds; returns the weight version that served it (None if the
        engine does not say). A generation: not done in time is a 504 and the engine is not taken for down (a
        busy engine queues the probe behind its work). This one speaks SGLang's ``/generate``."""
        answer = await self.engine.call("POST", "/generate", {"input_ids": [0], "sampling_params": {
            "max_new_tokens": 1, "temperature": 0}}, timeout=timeout, is_generation=True)
        meta = answer.get("meta_info")
        return peer_weight_version(meta.get("weight_version")) if isinstance(meta, dict) else None

    # -- weights and cache -------------------------------------------------------------
    @abstractmethod
    async def check_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """Check an ``update_weights_from_disk`` body without loading anything (400 if it cannot load)."""

    @abstractmethod
    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        """Load the checkpoint in place (weights resident, generation drained); the answer carries
        ``weight_version`` when the engine knows it."""

    @abstractmethod
    async def flush_cache(self, timeout: float) -> dict[str, Any]:
        """Drop the engine's prefix cache, within ``timeout`` seconds, whatever runs: requests running are
        never a reason to wait for an idle moment, which steady load never gives."""

    # -- SGLang's weight API beyond disk, and its in-engine pause ------------------------
    async def weight_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A tensor or broadcast update, the weight group, the update session, the version (``path`` with
        SGLang's ``body``); generation is drained when the call moves weights."""
        raise Unsupported(f"{path} is not available behind the sidecar for a {self.kind.value} engine")

    async def discard_broadcasts(self, body: dict[str, Any]) -> None:
        """Receive the broadcasts an ``update_weights_from_distributed`` body announces and drop them, loading
        nothing: the update was refused after its trainer began to broadcast (a drain that timed out), and a
        group whose engine missed them would pair the next update's names with these tensors."""
        raise Unsupported(f"discarding broadcasts is not available for a {self.kind.value} engine")

    async def check_tensor_payload(self, body: dict[str, Any]) -> dict[str, Any]:
        """Read and check an ``update_weights_from_tensor`` payload, load nothing (400 if it cannot load). The
        read releases the sender's reference (with the body's ``release_sender_reference``), as a load does."""
        raise Unsupported(f"a dry run of update_weights_from_tensor is not available for a {self.kind.value} engine")

    async def pause(self, mode: str) -> dict[str, Any]:
        """SGLang's ``retract`` or ``in_place`` pause, in the engine (``abort`` and ``wait`` are the sidecar's)."""
        raise Unsupported(f"pause mode {mode} is not available for a {self.kind.value} engine; use abort or wait")

    async def continue_generation(self, *, torch_empty_cache: bool) -> dict[str, Any]:
        """End an in-engine pause; an engine that cannot pause has nothing to continue."""
        return {}

    async def info(self, path: str) -> dict[str, Any] | None:
        """A read-only info endpoint (``/get_server_info``, ``/get_weight_version``, ``/model_info``,
        ``/get_model_info``) for an engine that has no such endpoint; None: the engine's own is passed through."""
        return None


def tags_named(meanings: Mapping[str, TagMeaning], names: list[str]) -> list[str]:
    """The engine's own names for the SPEC tags ``names`` that have a region in the engine, in order."""
    return [meanings[name].engine_tag for name in names if meanings[name].engine_tag is not None]  # type: ignore[misc]


def not_understood(engine: str, path: str, what: str, **extra: Any) -> EngineRefused:
    """An answer to ``path`` that is not ``engine``'s (a 2xx without its word, a proxy's redirect): 502
    ``upstream_error``, and nothing is taken from it (no state, no version, no validity)."""
    return EngineRefused(E.UPSTREAM_ERROR.status, {"error": {"type": E.UPSTREAM_ERROR.name, "message": (
        f"{engine} answered {path} with {what}: not {engine}'s answer, so what it did is not known"), **extra}})

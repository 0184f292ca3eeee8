"""Memory tags, tag states and backup modes (SPEC sections 2, 3 and 9).

Tag lists in request bodies follow SGLang: ``null`` (or absent) means every
tag, ``[]`` means no tag (a no-op), and an unknown name is an error.
"""

from __future__ import annotations

import enum
from typing import Iterable, NamedTuple


class Tag(str, enum.Enum):
    """A memory region of the engine; every allocation of its steady state belongs to exactly one."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"
    WORKSPACE = "workspace"  # attention and sampling scratch buffers


ALL_TAGS: tuple[Tag, ...] = tuple(Tag)
TAG_NAMES: tuple[str, ...] = tuple(tag.value for tag in ALL_TAGS)
MAX_BYTE_COUNT = (1 << 63) - 1  # an int64: a larger figure from a peer is no count of a machine's bytes


def is_byte_count(value: object) -> bool:
    """Whether a peer's ``value`` can be a count of bytes (a tag's, the device's): an integer from 0 to
    :data:`MAX_BYTE_COUNT`, never ``true``, a negative or a 4,300-digit number."""
    return type(value) is int and 0 <= value <= MAX_BYTE_COUNT


class TagState(str, enum.Enum):
    """Where a tag is. The engine knows ``resident`` and ``released``; the sidecar also the moves between."""

    RESIDENT = "resident"
    RELEASING = "releasing"
    RELEASED = "released"
    RESUMING = "resuming"


TAG_STATE_NAMES: tuple[str, ...] = tuple(state.value for state in TagState)


class BackupMode(str, enum.Enum):
    """Where the weights are kept while released (``--weights-backup``)."""

    NONE = "none"
    CPU = "cpu"
    DISK = "disk"


class UnknownTag(ValueError):
    """A tag name outside :data:`TAG_NAMES`."""


MAX_SHOWN_NAMES = 8
MAX_SHOWN_CHARS = 80


def shown_names(names: list[str]) -> str:
    """Unknown names as an error shows them: the first few, each cut short, so a body of megabytes of tag names
    is not echoed back whole."""
    shown = [name if len(name) <= MAX_SHOWN_CHARS else f"{name[:MAX_SHOWN_CHARS]}...({len(name)} characters)"
             for name in names[:MAX_SHOWN_NAMES]]
    more = f" and {len(names) - MAX_SHOWN_NAMES} more" if len(names) > MAX_SHOWN_NAMES else ""
    return f"{shown}{more}"


def parse_tags(names: Iterable[str] | None) -> tuple[Tag, ...] | None:
    """Tag names -> tags in canonical order, without duplicates.

    ``None`` stays ``None`` (all tags: the caller decides what "all" means for
    its call); an empty list gives ``()`` (nothing). Raises :class:`UnknownTag`
    naming every unknown name.
    """
    if names is None:
        return None
    wanted = list(names)
    unknown = [name for name in wanted if name not in TAG_NAMES]
    if unknown:
        raise UnknownTag(f"unknown memory tag(s) {shown_names(unknown)}; known: {list(TAG_NAMES)}")
    return tuple(tag for tag in ALL_TAGS if tag.value in wanted)


# SGLang names a drafter's weights (speculative decoding) as a tag of its own; this engine has no drafter.
DRAFTER_TAG = "weights_drafter"
SGLANG_TAG_NAMES: tuple[str, ...] = (*TAG_NAMES, DRAFTER_TAG)


class TagRequest(NamedTuple):
    """The tags a release or resume asks for, as handoff runs it.

    ``tags``: None (all), ``()`` (none) or the tags in canonical order.
    ``not_present``: names accepted but with nothing behind them here (``weights_drafter``).
    """

    tags: tuple[Tag, ...] | None
    not_present: tuple[str, ...]

    @property
    def names(self) -> list[str] | None:
        """Tag names in canonical order; None (all) stays None."""
        return None if self.tags is None else [tag.value for tag in self.tags]

    def report(self, answer: dict) -> dict:
        """``answer`` with ``not_present`` added when some names had nothing behind them."""
        if self.not_present:
            answer["not_present"] = list(self.not_present)
        return answer


def parse_tag_request(names: Iterable[str] | None) -> TagRequest:
    """Tag names as SGLang clients send them -> :class:`TagRequest`.

    SGLang clients know ``weights``, ``kv_cache`` and ``cuda_graph`` (and
    ``weights_drafter``); handoff also has ``workspace``, the scratch buffers a
    step needs. So ``workspace`` follows ``kv_cache`` when not named: a client
    that resumes ``kv_cache`` gets a node that can serve, and one that releases
    it gives the workspace back too. ``weights_drafter`` is accepted and
    reported as not present. Unknown names raise :class:`UnknownTag`.
    """
    if names is None:
        return TagRequest(None, ())
    wanted = list(names)
    not_present = tuple(dict.fromkeys(name for name in wanted if name == DRAFTER_TAG))
    own = [name for name in wanted if name != DRAFTER_TAG]
    if Tag.KV_CACHE.value in own and Tag.WORKSPACE.value not in own:
        own.append(Tag.WORKSPACE.value)
    try:
        tags = parse_tags(own)
    except UnknownTag:
        unknown = [name for name in wanted if name not in SGLANG_TAG_NAMES]
        raise UnknownTag(f"unknown memory tag(s) {shown_names(unknown)}; known: {list(SGLANG_TAG_NAMES)}") from None
    return TagRequest(tags, not_present)

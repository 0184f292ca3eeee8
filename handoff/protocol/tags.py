"""Memory tags, tag states and backup modes (SPEC sections 2, 3 and 9).

Tag lists in request bodies follow SGLang: ``null`` (or absent) means every
tag, ``[]`` means no tag (a no-op), and an unknown name is an error.
"""

from __future__ import annotations

import enum
from typing import Iterable


class Tag(str, enum.Enum):
    """A memory region of the engine; every allocation of its steady state belongs to exactly one."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"
    WORKSPACE = "workspace"  # attention and sampling scratch buffers


ALL_TAGS: tuple[Tag, ...] = tuple(Tag)
TAG_NAMES: tuple[str, ...] = tuple(tag.value for tag in ALL_TAGS)


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
        raise UnknownTag(f"unknown memory tag(s) {unknown}; known: {list(TAG_NAMES)}")
    return tuple(tag for tag in ALL_TAGS if tag.value in wanted)

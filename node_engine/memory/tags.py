"""The four memory tags and their per-tag state in the engine."""

from __future__ import annotations

import enum
from typing import Iterable


class MemoryTag(str, enum.Enum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"
    WORKSPACE = "workspace"


ALL_TAGS: tuple[MemoryTag, ...] = tuple(MemoryTag)


class TagState(str, enum.Enum):
    RESIDENT = "resident"
    RELEASED = "released"


class BackupMode(str, enum.Enum):
    NONE = "none"
    CPU = "cpu"
    DISK = "disk"


def parse_tags(value: Iterable[str] | None) -> list[MemoryTag] | None:
    """Tag names to tags, in the canonical order, without duplicates; ``None`` stays ``None`` (all).

    Raises ``ValueError`` naming any unknown tag.
    """
    if value is None:
        return None
    names = list(value)
    unknown = [n for n in names if n not in MemoryTag._value2member_map_]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; known: {[t.value for t in ALL_TAGS]}")
    wanted = set(names)
    return [t for t in ALL_TAGS if t.value in wanted]

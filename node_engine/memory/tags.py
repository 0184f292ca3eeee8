"""The engine's names for the shared tag vocabulary of :mod:`handoff.protocol.tags`.

The engine itself only ever has a tag ``resident`` or ``released``; the moves
between are the sidecar's.
"""

from __future__ import annotations

from handoff.protocol.tags import ALL_TAGS, BackupMode, TagState, UnknownTag, parse_tags
from handoff.protocol.tags import Tag as MemoryTag

__all__ = ["ALL_TAGS", "BackupMode", "MemoryTag", "TagState", "UnknownTag", "parse_tags"]

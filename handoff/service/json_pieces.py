"""Large JSON worked on a thread without holding the event loop: written and read in small steps.

CPython's C JSON encoder and decoder hold the GIL for a whole call, so a thread that encodes or parses tens of
megabytes in one call stops the event loop just as if the loop did it. :func:`render_in_pieces` writes a value
by encoder calls of bounded size (``loads_bounded(..., in_turns=True)`` parses in turns); :func:`gc_paused` keeps
the cyclic collector from walking a large acyclic tree being built (one pass over millions of objects is a
pause of its own) and :func:`drop_in_pieces` frees one a few items at a time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import threading
from typing import Any, Iterator

__all__ = ["PIECE_DEPTH", "drop_in_pieces", "gc_paused", "render_in_pieces"]

_DUMPS = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
PIECE_DEPTH = 4  # an OpenAI answer, its choices, a choice, its logprobs: their lists below are encoded in pieces
_PIECE = 256  # items of such a list per encoder call


def render_in_pieces(value: Any, depth: int = 0, *, piece_depth: int = PIECE_DEPTH) -> str:
    """``value``'s JSON as ``JSONResponse`` renders it, made by encoder calls of bounded size: the containers
    down to ``piece_depth`` one by one, a list below it ``_PIECE`` items at a time. The C encoder holds the GIL
    for a whole call (0.9 s for 64 chat choices of 100 tokens with 64 top logprobs each), so a thread that
    renders in pieces leaves the event loop its turns."""
    if depth < piece_depth and isinstance(value, dict):
        return "{" + ",".join(f"{_key(key)}:{render_in_pieces(item, depth + 1, piece_depth=piece_depth)}"
                              for key, item in value.items()) + "}"
    if isinstance(value, list) and value:
        if depth < piece_depth:
            return "[" + ",".join(render_in_pieces(item, depth + 1, piece_depth=piece_depth) for item in value) + "]"
        return "[" + ",".join(_DUMPS(value[i:i + _PIECE])[1:-1] for i in range(0, len(value), _PIECE)) + "]"
    return _DUMPS(value)


def drop_in_pieces(value: Any) -> None:
    """Empty ``value``'s lists and dicts a few items at a time. The last reference to a large tree frees all of
    it in one C call, holding the GIL as long as building it did."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
            item.clear()
        elif isinstance(item, list):
            while item:
                piece = item[-_PIECE:]
                del item[-_PIECE:]
                pending.extend(child for child in piece if isinstance(child, (list, dict)))


def _key(key: Any) -> str:
    """A dict key as JSON writes it: a string always (``1`` as ``"1"``, ``None`` as ``"null"``)."""
    return _DUMPS(key) if isinstance(key, str) else _DUMPS({key: 0})[1:-3]


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off while the block runs (on any thread; nested and concurrent blocks too), on again
    as it was when the last block ends. For a block that builds a large acyclic tree and drops it before it
    ends: reference counting frees it, and the collector never walks it."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()

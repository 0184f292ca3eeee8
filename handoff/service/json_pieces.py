"""Large JSON worked on a thread without holding the event loop: written and read in small steps.

CPython's C JSON encoder and decoder hold the GIL for a whole call, so a thread that encodes or parses tens of
megabytes in one call stops the event loop just as if the loop did it. :func:`render_in_pieces` writes a value
by encoder calls of bounded size (``loads_bounded(..., in_turns=True)`` parses in turns); :func:`gc_paused` keeps
the cyclic collector from walking a large acyclic tree being built (one pass over millions of objects is a
pause of its own; for a few seconds at most) and :func:`drop_in_pieces` frees one a few items at a time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["GC_PAUSE_CAP", "GcPause", "PIECE_DEPTH", "drop_in_pieces", "gc_paused", "render_in_pieces"]

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


GC_PAUSE_CAP = 2.0  # seconds one pause of the collector may last before a new block stops extending it


class GcPause:
    """``with pause():`` keeps the cyclic collector off while the block runs (on any thread; nested and concurrent
    blocks too) and turns it on again, as it was, when the last block ends. For a block that builds a large acyclic
    tree and drops it before it ends: reference counting frees it, and the collector never walks it (one full
    pass over millions of objects holds the GIL as long as building them did).

    Bounded: a block that starts once the collector has been off for ``cap`` seconds does not extend the pause; it
    runs with the collector on as soon as the blocks that turned it off have ended. Without the bound, blocks that
    overlap without a gap (a steady stream of large PD merges) would keep it off for good, and the event loop's
    cyclic garbage (futures, exceptions with their tracebacks) would pile up. The collector is thus off at most
    ``cap`` plus the longest block that started within it, and its young generation (everything allocated during
    the pause) is collected as it comes back on after such a long pause: a new pause starting at once would
    otherwise find that garbage still there. Cutting in on running blocks instead (turning the collector on under
    them) would let a collection walk exactly the trees they build; this way a block that paused the collector is
    never walked by it, and only a block that started past the cap may be, at most once per ``cap`` seconds.

    ``clock`` gives the time in seconds (``time.monotonic``; a test passes its own). The process uses one
    instance, :data:`gc_paused`: two would not see each other's blocks."""

    def __init__(self, *, cap: float = GC_PAUSE_CAP, clock: Callable[[], float] = time.monotonic) -> None:
        self._cap, self._clock = cap, clock
        self._lock = threading.Lock()
        self._pausers = 0  # running blocks that keep the collector off
        self._was_enabled = False
        self._off_since = 0.0
        self._overdue = False  # a block found the pause past the cap

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        pauses = self._enter()
        try:
            yield
        finally:
            if pauses:
                self._leave()

    def _enter(self) -> bool:
        """Whether this block keeps the collector off: it turns it off, or joins a pause younger than the cap."""
        with self._lock:
            if self._pausers == 0:
                self._was_enabled, self._off_since, self._overdue = gc.isenabled(), self._clock(), False
                gc.disable()
            elif self._clock() - self._off_since >= self._cap:
                self._overdue = True
                return False
            self._pausers += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._pausers -= 1
            if self._pausers or not self._was_enabled:
                return
            gc.enable()
            overdue = self._overdue
        if overdue:
            gc.collect(0)


gc_paused = GcPause()

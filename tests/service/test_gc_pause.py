"""The cyclic collector paused for large JSON trees comes back on under overlapping pauses (json_pieces.GcPause)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Iterator

import pytest

from handoff.service.json_pieces import GcPause


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    gc.enable()
    yield
    gc.enable()


def test_a_pause_within_the_cap_keeps_the_collector_off_until_its_last_block_ends() -> None:
    clock = _Clock()
    pause = GcPause(cap=2.0, clock=clock)
    with pause():
        assert not gc.isenabled()
        clock.now = 1.0
        with pause():
            assert not gc.isenabled()
        clock.now = 1.9
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # off before the first block: left off
    with pause():
        clock.now = 9.0
        with pause():
            pass
    assert not gc.isenabled()


def test_overlapping_pauses_past_the_cap_give_the_collector_back() -> None:
    clock = _Clock()
    pause = GcPause(cap=2.0, clock=clock)
    with contextlib.ExitStack() as late:
        first, second = pause(), pause()
        first.__enter__()
        clock.now = 1.5
        second.__enter__()
        clock.now = 1.8
        first.__exit__(None, None, None)
        garbage = _Cycle()
        alive = weakref.ref(garbage)
        del garbage
        clock.now = 2.5  # past the cap: this block does not extend the pause
        late.enter_context(pause())
        assert not gc.isenabled()
        clock.now = 3.0
        second.__exit__(None, None, None)
        assert gc.isenabled()  # while the late block still runs
        assert alive() is None  # the pause's garbage collected as the collector came back on
        clock.now = 3.2
        with pause():  # a fresh pause
            assert not gc.isenabled()
    assert gc.isenabled()


def test_a_steady_stream_of_overlapping_blocks_leaves_the_collector_off_a_bounded_time() -> None:
    clock = _Clock()
    pause = GcPause(cap=2.0, clock=clock)
    length, every = 1.0, 0.25  # four blocks at once, never a gap
    running: list[tuple[float, contextlib.AbstractContextManager[None]]] = []
    off_since: float | None = None
    longest = 0.0
    turned_on = 0
    made: list[tuple[float, weakref.ref[_Cycle]]] = []
    for step in range(400):
        clock.now = step * every
        for ends, block in [item for item in running if item[0] <= clock.now]:
            running.remove((ends, block))
            block.__exit__(None, None, None)
        # the event loop's cyclic garbage: none of it outlives a pause's bound
        assert all(ref() is None for when, ref in made if when < clock.now - (2.0 + length + every))
        made.append((clock.now, weakref.ref(_Cycle())))
        if gc.isenabled() and off_since is not None:  # back on, if only until the next block starts
            longest, off_since, turned_on = max(longest, clock.now - off_since), None, turned_on + 1
        block = pause()
        block.__enter__()
        running.append((clock.now + length, block))
        if not gc.isenabled() and off_since is None:
            off_since = clock.now
    for _, block in running:
        block.__exit__(None, None, None)
    assert gc.isenabled()
    assert turned_on >= 30  # back on about every cap + length seconds of the 100 s
    assert longest <= 2.0 + length

"""The KV bookkeeping's invariants, checked on a scheduler between two calls (the interleaving and the scheduler
model tests): every slot free, owned by one running request or held by the prefix cache; every row free or held by
one running request; each cache entry locked exactly by the running requests that reuse it."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from node_engine.prefix_cache import PrefixCache
from node_engine.request import Request, RequestState
from node_engine.scheduler import Scheduler


def _cache_slots(cache: PrefixCache, running: list[Request]) -> list[int]:
    """Slots the cache holds (entries detached by a flush included); checks each entry's lock count."""
    locks: collections.Counter[int] = collections.Counter()
    detached = {}
    for request in running:
        node = request.prefix_node
        while node is not None and node.parent is not None:
            locks[id(node)] += 1
            if node.is_detached:
                detached[id(node)] = node
            node = node.parent
    nodes = cache._nodes()
    for node in nodes + list(detached.values()):
        assert node.lock_ref == locks[id(node)], "a cache entry's lock count is not its users"
    slots = [s for node in nodes + list(detached.values()) for s in node.slots.tolist()]
    assert len(slots) == cache.num_cached_tokens, "the cache counts tokens it does not hold (or the reverse)"
    return slots


def check_invariants(scheduler: Scheduler, requests: Iterable[Request]) -> None:
    """``requests``: every request the test made, whatever its state."""
    free = [s for chunk in scheduler.slots._free_chunks for s in chunk.tolist()]
    assert len(free) == scheduler.slots.num_free, "the free count is not the free slots"
    owned = []
    for request in scheduler.running:
        assert request.state is RequestState.RUNNING and request.row is not None
        num_prefix = request.prefix_slots.numel() if request.prefix_slots is not None else 0
        assert request.num_cached == num_prefix + request.num_owned_slots
        owned += [s for chunk in request.slots for s in chunk.tolist()] + request.decode_slots
    cached = _cache_slots(scheduler.cache, scheduler.running) if scheduler.cache is not None else []
    every = free + owned + cached
    assert len(every) == len(set(every)), "a KV slot has two owners"
    assert sorted(every) == list(range(1, scheduler.slots.capacity + 1)), "a KV slot leaked"
    rows = scheduler.rows._free + [r.row for r in scheduler.running]
    assert sorted(rows) == list(range(scheduler.rows.num_rows)), "a request row leaked"
    for request in requests:
        if request.state is not RequestState.RUNNING:
            assert request not in scheduler.running
            assert not request.num_owned_slots and request.row is None and request.prefix_node is None
        if request.state is RequestState.FINISHED:
            assert request not in scheduler.waiting
        if request.state is RequestState.WAITING:
            assert request in scheduler.waiting and request.num_cached == 0

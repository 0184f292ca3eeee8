"""The prefix cache on its own and inside the scheduler: reuse, eviction, flush, and slot accounting."""

from __future__ import annotations

import gc
import time
import weakref

from hypothesis import given, settings
from hypothesis import strategies as st

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.prefix_cache import PrefixCache
from node_engine.request import FinishReason, Request
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.tokenizer import Tokenizer

TOKENIZER = Tokenizer.builtin_bytes()


def cache_with(num_slots: int = 65) -> tuple[PrefixCache, SlotAllocator]:
    slots = SlotAllocator(num_slots)
    return PrefixCache(slots), slots


def test_match_finds_the_longest_prefix_and_splits_edges() -> None:
    cache, slots = cache_with()
    owned = slots.allocate(4)
    assert cache.insert([1, 2, 3, 4], owned) == 0
    prefix, node = cache.match([1, 2, 3, 9, 9])
    assert prefix.tolist() == owned[:3].tolist()
    assert cache.match([1, 2, 3, 4, 5])[0].tolist() == owned.tolist()
    assert cache.match([7])[0].numel() == 0
    assert cache.num_cached_tokens == 4


def test_insert_reports_what_was_cached_already() -> None:
    cache, slots = cache_with()
    cache.insert([1, 2, 3], slots.allocate(3))
    mine = slots.allocate(5)
    assert cache.insert([1, 2, 3, 4, 5], mine) == 3  # the caller frees mine[:3]
    slots.free(mine[:3])
    assert cache.num_cached_tokens == 5 and slots.num_used == 5


def test_eviction_takes_the_least_recently_used_unlocked_leaves() -> None:
    cache, slots = cache_with()
    cache.insert([1, 1], slots.allocate(2))
    cache.insert([2, 2], slots.allocate(2))
    cache.insert([3, 3], slots.allocate(2))
    _, locked = cache.match([1, 1])
    cache.lock(locked)
    cache.match([2, 2])  # now more recent than [3, 3]
    assert cache.evict(1) == 2
    assert cache.match([3, 3])[0].numel() == 0 and cache.match([2, 2])[0].numel() == 2
    assert cache.evict(100) == 2  # [1, 1] is locked: only [2, 2] goes
    assert cache.match([1, 1])[0].numel() == 2
    cache.unlock(locked)
    assert cache.evict(100) == 2 and slots.num_used == 0


def test_flush_frees_now_or_when_the_last_user_unlocks() -> None:
    cache, slots = cache_with()
    cache.insert([1, 2, 3], slots.allocate(3))
    cache.insert([5, 6], slots.allocate(2))
    _, in_use = cache.match([1, 2, 3])
    cache.lock(in_use)
    epoch = cache.epoch
    assert cache.flush() == 5
    assert cache.epoch == epoch + 1
    assert slots.num_used == 3                        # [5, 6] freed at once, [1, 2, 3] still in use
    assert cache.match([1, 2, 3])[0].numel() == 0     # but never matched again
    cache.unlock(in_use)
    assert slots.num_used == 0 and cache.num_cached_tokens == 0


def make_request(rid: str, prompt: list[int], max_new: int) -> Request:
    return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, temperature=0),
                   detokenizer=IncrementalDetokenizer(TOKENIZER), on_output=lambda _: None)


def run_to_end(s: Scheduler, token: int = 70, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        step = s.schedule()
        if step is None:
            return
        s.postprocess(step, [token] * sum(e.samples for e in step.entries))
    raise AssertionError("the scheduler did not finish")


def test_a_repeated_prompt_reuses_the_cached_prefix() -> None:
    slots = SlotAllocator(129)
    s = Scheduler(SchedulerConfig(max_running_requests=4, max_batch_tokens=64, context_len=128,
                                  eos_token_ids=(257,)), slots, RowAllocator(4), PrefixCache(slots))
    prompt = list(range(10, 40))
    s.add(make_request("a", prompt, 4))
    run_to_end(s)
    s.add(make_request("b", prompt, 4))
    step = s.schedule()
    entry = step.entries[0]
    assert entry.start == len(prompt) - 1 and entry.prefix is not None and entry.prefix.numel() == len(prompt) - 1
    assert s.num_prefix_hit_tokens == len(prompt) - 1


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
       max_new=st.integers(1, 6), num_slots=st.integers(24, 80), abort_every=st.integers(2, 5))
def test_slots_always_balance(prompts: list[list[int]], max_new: int, num_slots: int, abort_every: int) -> None:
    """Whatever the mix of shared prefixes, eviction, preemption and aborts: no slot is lost or doubled."""
    slots = SlotAllocator(num_slots)
    cache = PrefixCache(slots)
    s = Scheduler(SchedulerConfig(max_running_requests=3, max_batch_tokens=8, context_len=64, eos_token_ids=()),
                  slots, RowAllocator(3), cache)
    requests = [make_request(str(i), p, max_new) for i, p in enumerate(prompts)]
    for r in requests:
        s.add(r)
    for n in range(10_000):
        step = s.schedule()
        if step is None:
            break
        s.postprocess(step, [n % 4] * sum(e.samples for e in step.entries))
        if n % abort_every == 0 and s.running:
            s.finish(s.running[0], FinishReason.ABORT)
        held = sum(r.num_owned_slots for r in s.running)
        assert slots.num_free + held + cache.num_cached_tokens == slots.capacity
    assert not s.has_work
    cache.flush()
    assert slots.num_free == slots.capacity and cache.num_cached_tokens == 0


def test_reset_frees_the_old_tree_when_the_first_root_is_frozen() -> None:
    """A root built at startup and frozen out of the collector (``gc.freeze``, which a service may call before
    serving): the tree cached under it later is freed by a reset. It never was: the nodes point back at the
    root, and the frozen root's dict kept them from the collector."""
    cache, slots = cache_with()
    gc.collect()
    gc.freeze()
    try:
        cache.insert([1, 2, 3, 4], slots.allocate(4))
        cache.insert([1, 2, 7], slots.allocate(3))  # a split: an inner node and two leaves, each pointing up
        cached = [weakref.ref(node.slots) for node in cache._nodes()]
        assert len(cached) == 3
        slots.reset()
        cache.reset()
        gc.collect()
        assert [ref() for ref in cached] == [None, None, None]
    finally:
        gc.unfreeze()


def test_a_second_flush_does_not_count_again_what_the_first_dropped() -> None:
    """Entries in use at a flush are dropped by it (freed at their last unlock): a second flush before then
    reported them dropped again (a weight update per bucket with ``flush_cache`` under an in-place pause)."""
    cache, slots = cache_with()
    cache.insert([1, 2, 3], slots.allocate(3))
    cache.insert([5, 6], slots.allocate(2))
    _, in_use = cache.match([1, 2, 3])
    cache.lock(in_use)
    assert cache.flush() == 5
    cache.insert([7, 8], slots.allocate(2))
    assert cache.flush() == 2
    assert cache.num_cached_tokens == 3  # the slots it still holds: the detached entry in use
    cache.unlock(in_use)
    assert slots.num_used == 0 and cache.num_cached_tokens == 0 and cache.flush() == 0


def test_what_eviction_can_free_is_known_without_walking_the_tree() -> None:
    """Every admission the pool refuses asks what eviction could free: that walked the whole tree, 5 ms a call at
    10,000 entries, each step while a request waits. Now a count kept with every lock, insert, eviction and flush."""
    slots = SlotAllocator(200_000)
    cache = PrefixCache(slots)
    for i in range(20_000):
        ids = [i % 50, i % 977, i, i + 1]
        cache.insert(ids, slots.allocate(len(ids)))
    _, node = cache.match([3, 3, 3, 4])
    cache.lock(node)
    started = time.process_time()  # CPU time, which a loaded box does not inflate
    for _ in range(2_000):  # each walk takes ms: 2,000 take many seconds
        evictable = cache.num_evictable_tokens
    assert time.process_time() - started < 1.0
    assert evictable == cache.num_cached_tokens - 4
    assert cache.evict(10**9) == evictable
    cache.unlock(node)
    assert cache.num_evictable_tokens == 4 == cache.evict(10**9)

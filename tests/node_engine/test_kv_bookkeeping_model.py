"""The scheduler model of ``test_scheduler_model`` with what an engine also sees: ``n`` samples submitted after
their shared prompt's prefill, ``in_place`` pauses (running requests keep their KV; aborts and flushes go on),
requests cut by the gate to the exact limit the pool leaves, and admissions the pool cannot take.

Over the invariants of ``kv_invariants`` (every slot free, owned once or cached; rows; lock counts), it checks that
room is checked before it is made: an admission, a prefill chunk or a decode step refused for want of slots leaves
the prefix cache as it was, and a schedule that plans nothing changes nothing.
"""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.prefix_cache import PrefixCache
from node_engine.request import FinishReason, Request
from node_engine.request_gate import RequestGate
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.step import Step
from tests.node_engine.test_scheduler_model import BASES, CONTEXT, EOS, TOKENIZER, SchedulerModel, StandInModel, \
    _request


def _sample(rid: str, prompt: list[int], max_new: int, *, ignore_eos: bool = False) -> Request:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos)
    return Request(rid=rid, prompt_ids=prompt, params=params,
                   detokenizer=IncrementalDetokenizer(TOKENIZER, (), is_lazy=True), on_output=lambda _: None)


def _watch_refusals(scheduler: Scheduler) -> list[str]:
    """Record every ``make_room`` refused after it changed the cache (it evicted for room it could not make)."""
    failures: list[str] = []
    kv = scheduler.kv
    make_room: Callable[[int], bool] = kv.make_room

    def checked(num: int) -> bool:
        before = kv.cache.num_cached_tokens if kv.cache is not None else 0
        if make_room(num):
            return True
        after = kv.cache.num_cached_tokens if kv.cache is not None else 0
        if after != before:
            failures.append(f"refused {num} slots after evicting {before - after} cached ones")
        return False

    kv.make_room = checked  # type: ignore[method-assign]
    return failures


class EngineBookkeepingModel(SchedulerModel):
    """``SchedulerModel`` plus the engine's ``n`` samples, ``in_place`` pauses and exact limits."""

    @initialize(num_slots=st.integers(12, 48), max_running=st.integers(1, 5), max_batch_tokens=st.integers(1, 20),
                with_cache=st.integers(0, 3).map(bool))
    def start(self, num_slots: int, max_running: int, max_batch_tokens: int, with_cache: bool) -> None:
        super().start(num_slots, max_running, max_batch_tokens, with_cache)
        self.gate = RequestGate(self.scheduler, None, vocab_size=EOS + 1, context_len=CONTEXT)  # type: ignore[arg-type]
        self.samples: dict[str, tuple[list[int], int, int]] = {}  # prefill rid -> (prompt, n, max_new)
        self.bad_evictions = _watch_refusals(self.scheduler)

    def run_steps(self, num: int) -> bool:
        for _ in range(num):
            before = self._held()
            step = self.scheduler.schedule()
            if step is None:
                assert self._held() == before, "a schedule that planned nothing changed the KV bookkeeping"
                return False
            self._run(step)
        return True

    def _run(self, step: Step) -> None:
        for request in self.scheduler.postprocess(step, self.model.run(step)):
            if request.finish_reason is not None:
                self._answer(request)

    def _held(self) -> tuple[int, int]:
        cache = self.scheduler.cache
        return self.scheduler.slots.num_free, cache.num_cached_tokens if cache is not None else 0

    # -- calls ---------------------------------------------------------------------------------------
    @precondition(lambda self: not self.is_released)
    @rule(base=st.sampled_from(BASES), tail=st.lists(st.integers(40, 41), max_size=6), n=st.integers(2, 4),
          max_new=st.integers(1, 24))
    def submit_n(self, base: list[int], tail: list[int], n: int, max_new: int) -> None:
        """``n`` samples of one prompt: its prefill first (``max_new_tokens`` 0, cached), the samples once it is
        answered (``GenerationRun``), so that they share its KV through the prefix cache."""
        prompt = base + tail
        if len(prompt) >= self.gate.max_input_tokens():
            return
        rid = f"r{len(self.requests)}-prefill"
        warm_up = _request(rid, prompt, SamplingParams(max_new_tokens=0), use_cache=True, prefill=True,
                           logprob_start=None)
        self.requests.append(warm_up)
        self.samples[rid] = (prompt, n, max_new)
        self.scheduler.add(warm_up)

    @precondition(lambda self: not self.is_released)
    @rule(base=st.sampled_from(BASES), tail=st.lists(st.integers(40, 41), max_size=40))
    def submit_to_the_limit(self, base: list[int], tail: list[int]) -> None:
        """A request that never stops, its ``max_new_tokens`` cut by the gate to exactly what the pool leaves."""
        prompt = (base + tail)[:self.gate.max_input_tokens() - 1]
        room = self.gate.cap_new_tokens(len(prompt), SamplingParams(max_new_tokens=10_000)).max_new_tokens
        assert len(prompt) + room == self.scheduler.max_request_tokens() - 2
        request = _sample(f"r{len(self.requests)}", prompt, room, ignore_eos=True)
        self.requests.append(request)
        self.scheduler.add(request)

    @precondition(lambda self: not self.is_paused)
    @rule()
    def pause_in_place(self) -> None:
        """``in_place``: running requests keep their KV and row; nothing steps until continue."""
        self.is_paused = True

    def _answer(self, request: Request) -> None:
        super()._answer(request)
        planned = self.samples.pop(request.rid, None)
        if planned is None or request.rid in self.failed or request.finish_reason is FinishReason.ABORT:
            return
        prompt, n, max_new = planned
        limit = self.gate.cap_new_tokens(len(prompt), SamplingParams(max_new_tokens=max_new)).max_new_tokens
        for index in range(n):
            sample = _sample(f"{request.rid}-{index}", prompt, limit)
            self.requests.append(sample)
            self.scheduler.add(sample)

    @invariant()
    def refused_room_changed_nothing(self) -> None:
        assert not self.bad_evictions, self.bad_evictions[0]

    @invariant()
    def evictable_count_is_what_eviction_frees(self) -> None:
        """The kept count is the tree's unlocked entries (detached ones, locked ancestors and splits included)."""
        cache = self.scheduler.kv.cache if hasattr(self, "scheduler") else None
        if cache is not None:
            walked = sum(node.slots.numel() for node in cache._nodes() if node.lock_ref == 0)
            assert cache.num_evictable_tokens == walked

    def teardown(self) -> None:
        super().teardown()
        assert not self.bad_evictions, self.bad_evictions[0]
        if hasattr(self, "scheduler"):
            assert not self.samples, "a prefill's samples were never submitted"


EngineBookkeepingModel.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                                    suppress_health_check=[HealthCheck.too_slow])
test_engine_bookkeeping_under_random_calls = pytest.mark.timeout(60)(EngineBookkeepingModel.TestCase)


def _scheduler(num_slots: int) -> tuple[Scheduler, StandInModel]:
    slots = SlotAllocator(num_slots)
    scheduler = Scheduler(SchedulerConfig(max_running_requests=2, max_batch_tokens=32, context_len=CONTEXT,
                                          eos_token_ids=(EOS,)), slots, RowAllocator(2), PrefixCache(slots))
    return scheduler, StandInModel(num_slots, 2)


def _run_to_end(scheduler: Scheduler, model: StandInModel) -> None:
    while (step := scheduler.schedule()) is not None:
        scheduler.postprocess(step, model.run(step))


def test_an_admission_the_pool_cannot_take_keeps_the_prefix_cache() -> None:
    """A waiting request that does not fit even with every cached prefix evicted stays waiting, and the cache keeps
    its entries for the requests that may reuse them (SGLang's ``PrefillAdder`` checks before it evicts)."""
    scheduler, model = _scheduler(20)
    scheduler.add(_sample("cached", [1, 2, 3, 4, 5, 6], 1))
    _run_to_end(scheduler, model)
    assert scheduler.cache.num_cached_tokens == 6
    scheduler.add(_sample("decoding", [9] * 8, 6))
    step = scheduler.schedule()
    scheduler.postprocess(step, model.run(step))
    assert scheduler.slots.num_free == 5
    big = _sample("big", [7] * 12, 1)  # 12 slots: 5 free + 6 evictable are not enough
    scheduler.add(big)
    step = scheduler.schedule()
    assert [e.request.rid for e in step.entries] == ["decoding"] and list(scheduler.waiting) == [big]
    assert scheduler.cache.num_cached_tokens == 6, "an admission that failed evicted the prefix cache"
    assert scheduler.slots.num_free == 4

"""Seeded random interleavings of the engine's calls, with the bookkeeping checked after every one.

A real engine (``builtin:tiny`` on the CPU, a small KV pool so that requests are preempted) is driven on the
test's thread exactly as its own thread drives it (take the inbox, then step), between random submissions,
aborts (one or all), pauses (``abort``, ``retract``, ``in_place``), continues, cache flushes, releases,
resumes and weight updates (the same weights, so answers stay comparable). After every call:

- every KV slot is free, owned by exactly one running request, or held by the prefix cache (never two);
- every request row is free or held by exactly one running request;
- a prefix cache entry is locked exactly by the running requests that reuse it;
- a finished or waiting request holds no slot, row or cache entry;
- no request is answered twice.

At the end (everything resumed and continued) every request was answered exactly once, nothing is locked,
every slot is free or cached, and every answer is what an uninterrupted run of that request gives (a prefix
of it for an aborted one), preempted or not.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.errors import MemoryReleased, RequestsInFlight, WeightsNotLoaded
from node_engine.memory.tags import MemoryTag
from node_engine.request import FinishReason, Request, RequestHandle, RequestOutput
from node_engine.sampling import SamplingParams
from tests.node_engine.kv_invariants import check_invariants
from tests.support.weights import tiny_weights

pytestmark = pytest.mark.timeout(120)

NUM_OPS = 600
RELEASES: list[list[MemoryTag] | None] = [None, [MemoryTag.KV_CACHE], [MemoryTag.KV_CACHE, MemoryTag.WORKSPACE],
                                          [MemoryTag.WEIGHTS]]


class _InlineLoop:
    """Stands for the event loop: outputs are dispatched at once, on the test's thread."""

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> None:
        fn(*args)


def _engine(max_total_tokens: int, max_batch_tokens: int, max_running: int, prefix_cache: bool = True,
            schedule_conservativeness: float = 1.0) -> Engine:
    engine = Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=max_total_tokens, context_length=64,
                                 max_batch_tokens=max_batch_tokens, max_running_requests=max_running,
                                 enable_memory_saver=True, enable_prefix_cache=prefix_cache,
                                 schedule_conservativeness=schedule_conservativeness))
    engine.outbox.attach(_InlineLoop())  # type: ignore[arg-type]
    return engine


def _settle(engine: Engine, max_steps: int = 0) -> None:
    """Take the inbox, then run up to ``max_steps`` steps, as the engine thread would."""
    engine._drain_inbox(block=False)
    for _ in range(max_steps):
        if not engine._can_step:
            return
        engine.steps.step()
        engine._drain_inbox(block=False)


@dataclass
class Interleaving:
    engine: Engine
    rng: random.Random
    weights: dict[str, torch.Tensor]
    prompts: list[list[int]] = field(default_factory=list)
    handles: dict[str, RequestHandle] = field(default_factory=dict)
    submitted: dict[str, tuple[list[int], SamplingParams]] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    outputs: dict[str, list[RequestOutput]] = field(default_factory=lambda: collections.defaultdict(list))

    def __post_init__(self) -> None:
        rng = self.rng
        base = [[256] + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
        # prompts that share prefixes, or are prefixes of each other: the prefix cache splits and reuses
        self.prompts = base + [base[0][:10] + [7, 8, 9], base[0] + [5], base[1][:-1]]

    # -- the calls ------------------------------------------------------------------------
    def submit(self) -> None:
        prompt = self.rng.choice(self.prompts)
        limit = self.engine.scheduler.max_request_tokens()
        if len(prompt) >= limit:
            return
        params = self._params(self.rng.randrange(0, min(40, limit - len(prompt)) + 1))
        try:
            self.engine.gate.check(prompt, params)
        except (MemoryReleased, WeightsNotLoaded):
            if self.rng.random() < 0.5:  # else it is refused on the engine thread, as after a race
                return
        handle = self.engine.submit(prompt, params, stream=self.rng.random() < 0.5,
                                    use_prefix_cache=self.rng.random() < 0.85, prefill=self.rng.random() < 0.2)
        self.handles[handle.rid] = handle
        self.submitted[handle.rid] = (prompt, params)

    def _params(self, max_new_tokens: int) -> SamplingParams:
        kind = self.rng.randrange(3)
        if kind == 0:
            return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        if kind == 1:
            return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9, top_p=0.9,
                                  seed=self.rng.randrange(1000), ignore_eos=True)
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                              stop_token_ids=[self.rng.randrange(1, 256)])

    def step(self) -> None:
        _settle(self.engine, self.rng.randrange(1, 6))

    def abort_one(self) -> None:
        live = [rid for rid in self.handles if not self._is_answered(rid)]
        if live:
            self.engine.abort(self.rng.choice(live))

    def abort_all(self) -> None:
        self.engine.abort(None)

    def pause(self) -> None:
        mode = self.rng.choice(["abort", "retract", "in_place"])
        if mode == "abort":  # as /pause_generation does it: abort everything, then pause
            self.engine.abort(None)
            _settle(self.engine)
        self.engine.control.pause(mode)

    def continue_generation(self) -> None:
        self.engine.control.continue_generation()

    def flush(self) -> None:
        self.engine.control.flush_cache()

    def release(self) -> None:
        try:
            self.engine.control.release(self.rng.choice(RELEASES), None)
        except RequestsInFlight:
            pass  # refused while requests hold KV: nothing changed, which the checks verify

    def resume(self) -> None:
        self.engine.control.resume(None)

    def update_weights(self) -> None:
        try:
            self._commit(flush_cache=self.rng.random() < 0.7)
        except RequestsInFlight:
            pass  # refused unless idle or paused: nothing changed

    def _commit(self, *, flush_cache: bool) -> None:
        self.engine.weights.commit(self.weights, is_complete=True, version=None, flush_cache=flush_cache,
                                   torch_empty_cache=False)

    # -- bookkeeping --------------------------------------------------------------------------
    def collect(self) -> None:
        for rid, handle in self.handles.items():
            while not handle._queue.empty():
                self.outputs[rid].append(handle._queue.get_nowait())
        scheduler = self.engine.scheduler
        for request in list(scheduler.running) + list(scheduler.waiting):
            self.requests[request.rid] = request

    def _is_answered(self, rid: str) -> bool:
        return any(out.is_final for out in self.outputs[rid])

    def finish(self) -> None:
        """Resume, continue and run until idle."""
        engine = self.engine
        engine.control.continue_generation()
        if not engine.memory.is_all_resident:
            engine.control.resume(None)
        if not engine.memory.weights_valid:
            self._commit(flush_cache=True)
        _settle(engine, 10_000)
        self.collect()


OPS: list[tuple[float, Callable[[Interleaving], None]]] = [
    (0.22, Interleaving.submit), (0.50, Interleaving.step), (0.05, Interleaving.abort_one),
    (0.01, Interleaving.abort_all), (0.04, Interleaving.pause), (0.07, Interleaving.continue_generation),
    (0.03, Interleaving.flush), (0.02, Interleaving.release), (0.04, Interleaving.resume),
    (0.02, Interleaving.update_weights),
]


def _uninterrupted(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    handle = engine.submit(prompt, params, use_prefix_cache=False)
    _settle(engine, 10_000)
    out = handle._queue.get_nowait()
    assert out.is_final and out.error is None
    return out.token_ids_delta


def check_answers(run: Interleaving, reference: Engine) -> collections.Counter[str]:
    """Every request answered once, with what an uninterrupted run gives; returns how they ended."""
    ends: collections.Counter[str] = collections.Counter()
    for rid, (prompt, params) in run.submitted.items():
        outputs = run.outputs[rid]
        assert [out.is_final for out in outputs].count(True) == 1 and outputs[-1].is_final, rid
        final = outputs[-1]
        if final.error is not None:
            ends["refused"] += 1
            continue
        tokens = [t for out in outputs for t in out.token_ids_delta]
        assert len(tokens) == final.num_output_tokens
        expected = _uninterrupted(reference, prompt, params)
        if final.finish_reason is FinishReason.ABORT:
            expected = expected[:len(tokens)]
        assert tokens == expected, (rid, final.finish_reason, final.num_retractions)
        ends[f"{final.finish_reason.value}{'-preempted' if final.num_retractions else ''}"] += 1
    return ends


def check_idle(engine: Engine) -> None:
    scheduler = engine.scheduler
    assert not scheduler.has_work
    assert scheduler.rows.num_free == scheduler.rows.num_rows
    cache = scheduler.cache
    num_cached = cache.num_cached_tokens if cache is not None else 0
    assert scheduler.slots.num_free + num_cached == scheduler.slots.capacity
    if cache is not None:
        assert cache.num_evictable_tokens == num_cached  # nothing locked, nothing detached left behind


# Admission reserves what requests will need (SGLang's): a pool runs out only where a decoding request's tokens left
# are under-reserved, reserved at new_token_ratio (0 under --schedule-conservativeness 0; 1 under ignore_eos).
@pytest.mark.parametrize("seed, max_total_tokens, max_batch_tokens, max_running, prefix_cache, conservativeness", [
    (0, 96, 16, 4, True, 1.0),
    (11, 40, 7, 6, True, 0.0),    # a pool smaller than the context: requests up to the whole pool, much preemption
    (2, 64, 5, 8, True, 1.0),     # tiny prefill chunks
    (3, 48, 16, 4, False, 1.0),
])
def test_random_interleavings_keep_the_bookkeeping_whole(seed: int, max_total_tokens: int, max_batch_tokens: int,
                                                         max_running: int, prefix_cache: bool,
                                                         conservativeness: float) -> None:
    rng = random.Random(seed)
    run = Interleaving(_engine(max_total_tokens, max_batch_tokens, max_running, prefix_cache, conservativeness), rng,
                       tiny_weights(0))
    weights, ops = [w for w, _ in OPS], [op for _, op in OPS]
    for index in range(NUM_OPS):
        op = rng.choices(ops, weights)[0]
        op(run)
        _settle(run.engine)
        run.collect()
        assert all([o.is_final for o in outs].count(True) <= 1 for outs in run.outputs.values()), "answered twice"
        try:
            check_invariants(run.engine.scheduler, run.requests.values())
        except AssertionError as exc:
            raise AssertionError(f"after call {index} ({op.__name__}): {exc}") from exc
    run.finish()
    check_invariants(run.engine.scheduler, run.requests.values())
    check_idle(run.engine)
    ends = check_answers(run, _engine(max_total_tokens, max_batch_tokens, max_running, prefix_cache=False))
    assert ends["length-preempted"] + ends["stop-preempted"] > 0  # the interleaving did preempt requests

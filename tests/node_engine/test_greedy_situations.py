"""A greedy request gives the same tokens on a real engine (``builtin:tiny``) whatever happens around it: alone,
after a prefix-cache hit, batched with others, preempted by a full pool, retracted across a ``kv_cache`` release
and resume, or aborted (a prefix of them); after an update to other weights, it gives the tokens of an engine that
only ever had those (no prefix cached under the old weights is reused, not even one a request paused in place across
the update computed). Afterwards every slot is free or cached and nothing is locked.

The engine is driven on the test's thread as its own thread drives it (``test_interleavings``' helpers).
"""

from __future__ import annotations

import pytest

from node_engine.engine import Engine
from node_engine.memory.tags import MemoryTag
from node_engine.request import FinishReason, RequestHandle, RequestOutput
from node_engine.sampling import SamplingParams
from tests.node_engine.kv_invariants import check_invariants
from tests.node_engine.test_interleavings import _engine, _settle
from tests.support.weights import tiny_weights

pytestmark = pytest.mark.timeout(60)

# not ignore_eos: a running request is then reserved only new_token_ratio of its tokens left (SGLang's estimate), so
# the pool does run out and requests are preempted (no EOS in these 14 tokens: the same tokens as under ignore_eos)
PARAMS = SamplingParams(max_new_tokens=14, temperature=0.0)
SHARED = [256, 3, 1, 4, 1, 5, 9, 2, 6]
PROMPTS = [SHARED + [5, 3, 5], SHARED + [8, 9], SHARED[:4] + [7, 7, 7, 7], [256, 42, 43, 44, 45, 46, 47]]


def _final(handle: RequestHandle) -> RequestOutput:
    out = handle._queue.get_nowait()
    assert out.is_final and out.error is None and handle._queue.empty()
    return out


def _run_all(engine: Engine, prompts: list[list[int]]) -> list[RequestOutput]:
    """Submitted together, run to the end."""
    handles = [engine.submit(p, PARAMS) for p in prompts]
    _settle(engine, 10_000)
    return [_final(h) for h in handles]


def _is_idle_and_whole(engine: Engine) -> None:
    scheduler = engine.scheduler
    check_invariants(scheduler, [])
    assert not scheduler.has_work and scheduler.rows.num_free == scheduler.rows.num_rows
    assert scheduler.slots.num_free + scheduler.cache.num_cached_tokens == scheduler.slots.capacity
    assert scheduler.cache.num_evictable_tokens == scheduler.cache.num_cached_tokens  # nothing locked


def test_a_greedy_request_gives_the_same_tokens_in_every_situation() -> None:
    reference = _engine(96, 16, 4, prefix_cache=False)
    expected = [_run_all(reference, [p])[0].token_ids_delta for p in PROMPTS]
    # 39 slots: two of these requests fill the pool; new_token_ratio 0 (SGLang's --schedule-conservativeness 0):
    # admission reserves a decoding request none of its tokens left, so requests admitted beside it are preempted
    engine = _engine(40, 7, 4, schedule_conservativeness=0.0)

    cold = _run_all(engine, [PROMPTS[0]])[0]
    warm = _run_all(engine, [PROMPTS[0]])[0]
    assert cold.token_ids_delta == warm.token_ids_delta == expected[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == len(PROMPTS[0]) - 1

    together = _run_all(engine, PROMPTS)  # batched, shared prefixes, the pool too small for all: preempted
    assert [o.token_ids_delta for o in together] == expected
    assert sum(o.num_retractions for o in together) > 0
    _is_idle_and_whole(engine)

    # retracted after a few tokens, the KV released and resumed (the cache with it), then continued
    handle = engine.submit(PROMPTS[1], PARAMS)
    _settle(engine, 4)
    engine.control.pause("retract")
    engine.control.release([MemoryTag.KV_CACHE], None)
    engine.control.resume([MemoryTag.KV_CACHE])
    assert engine.scheduler.cache.num_cached_tokens == 0
    engine.control.continue_generation()
    _settle(engine, 10_000)
    retracted = _final(handle)
    assert retracted.token_ids_delta == expected[1] and retracted.num_retractions == 1
    assert _run_all(engine, [PROMPTS[1]])[0].token_ids_delta == expected[1]

    handle = engine.submit(PROMPTS[2], PARAMS)
    _settle(engine, 3)
    engine.abort(handle.rid)
    _settle(engine)
    aborted = _final(handle)
    assert aborted.finish_reason is FinishReason.ABORT
    assert 0 < len(aborted.token_ids_delta) < len(expected[2])
    assert aborted.token_ids_delta == expected[2][:len(aborted.token_ids_delta)]
    _is_idle_and_whole(engine)


def _commit(engine: Engine, seed: int) -> None:
    """A weight update to ``builtin:tiny``'s weights of ``seed``, as ``/update_weights_from_disk`` commits it
    (the prefix cache flushed, the default)."""
    engine.weights.commit(tiny_weights(seed), is_complete=True, version=None, flush_cache=True,
                          torch_empty_cache=False)


def test_after_an_update_to_other_weights_no_prefix_of_the_old_ones_is_reused() -> None:
    reference = _engine(96, 16, 4, prefix_cache=False)
    _commit(reference, 1)
    expected = [_run_all(reference, [p])[0].token_ids_delta for p in PROMPTS]
    engine = _engine(40, 7, 4)
    _run_all(engine, PROMPTS)  # the prefix cache holds prefixes of the old weights
    # one request is paused in place mid-decode across the update: its KV (old weights) must not be cached after
    handle = engine.submit(PROMPTS[1], PARAMS)
    _settle(engine, 4)
    engine.control.pause("in_place")
    _commit(engine, 1)
    engine.control.continue_generation()
    _settle(engine, 10_000)
    assert _final(handle).finish_reason is FinishReason.LENGTH
    for prompt, tokens in zip(PROMPTS, expected, strict=True):  # one at a time: each may reuse what came before
        assert _run_all(engine, [prompt])[0].token_ids_delta == tokens
    assert [o.token_ids_delta for o in _run_all(engine, PROMPTS)] == expected
    _is_idle_and_whole(engine)

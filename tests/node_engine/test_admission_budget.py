"""Admission reserves the KV a request will still need, as SGLang's ``PrefillAdder`` does: its whole uncomputed
prompt, its ``min(max_new_tokens left, CLIP)`` and, for the requests already decoding, ``min(left, CLIP) *
new_token_ratio`` (1 under ``ignore_eos``); the ratio starts at 0.7, decays per decode step to 0.7 * 0.14 over 600
steps, is re-estimated on a retraction and reset when idle. Driven on CPU through the real scheduler and KV manager;
the recomputed prefill tokens and retractions are counted."""

from __future__ import annotations

import pytest

from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.prefix_cache import PrefixCache
from node_engine.request import Request
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.step import StepKind
from node_engine.token_budget import NewTokenRatio
from tests.node_engine.test_scheduler import make_request

pytestmark = pytest.mark.timeout(60)


def make(num_slots: int, *, cache: bool = False, max_running: int = 8, max_batch_tokens: int = 64) -> Scheduler:
    slots = SlotAllocator(num_slots)
    return Scheduler(SchedulerConfig(max_running_requests=max_running, max_batch_tokens=max_batch_tokens,
                                     context_len=4096, eos_token_ids=(257,)),
                     slots, RowAllocator(max_running), PrefixCache(slots) if cache else None)


def run(s: Scheduler, max_steps: int = 2000, arrivals: dict[int, list[Request]] | None = None) -> dict[str, int]:
    """Steps until idle, every sampled token 70 (never a stop); requests of ``arrivals[i]`` added before step i.
    Returns the prefill tokens computed, the decode steps and the preemptions."""
    arrivals = dict(arrivals or {})
    counts = {"prefilled": 0, "decodes": 0}
    for index in range(max_steps):
        for request in arrivals.pop(index, []):
            s.add(request)
        step = s.schedule()
        if step is None:
            if not arrivals:
                break
            continue
        if step.kind is StepKind.PREFILL:
            counts["prefilled"] += sum(e.end - e.start for e in step.entries)
        else:
            counts["decodes"] += 1
        s.postprocess(step, [70] * sum(1 for e in step.entries if e.samples))
    else:
        raise AssertionError("the scheduler never went idle")
    assert not s.has_work and s.slots.num_free + (s.cache.num_cached_tokens if s.cache else 0) == s.slots.capacity
    counts["preemptions"] = s.num_preemptions
    return counts


def test_a_prompt_that_would_overcommit_the_pool_waits_instead_of_being_retracted_again_and_again() -> None:
    """A 100-slot pool, two requests decoding (20-token prompts, 30 new tokens each), then a 55-token prompt asking
    for 30: the three need 185 slots. Before the fix the third was admitted as soon as its first chunk and one
    decode step fit; the pool ran out and requests were retracted and recomputed (248 prefill tokens for 95 of
    prompts with 16-token chunks, 4 retractions). SGLang's admission keeps it waiting until the two leave room: no
    recomputation."""
    s = make(101, max_batch_tokens=16)
    a, b, c = make_request("a", 20, 30), make_request("b", 20, 30), make_request("c", 55, 30)
    counts = run(s, arrivals={0: [a, b], 3: [c]})
    assert [len(r.output_ids) for r in (a, b, c)] == [30, 30, 30]
    assert (counts["prefilled"], counts["preemptions"]) == (95, 0)
    assert a.num_retractions == b.num_retractions == c.num_retractions == 0


def test_ignore_eos_requests_are_reserved_whole_and_never_retracted() -> None:
    """Under ``ignore_eos`` a running request is reserved all its tokens left (ratio 1): a pool that holds two of
    them at a time never retracts one, whatever the order they arrive in."""
    s = make(161, cache=True)
    requests = [make_request(f"r{i}", 10 + 3 * i, 40, ignore_eos=True) for i in range(6)]
    counts = run(s, arrivals={2 * i: [r] for i, r in enumerate(requests)})
    assert all(len(r.output_ids) == 40 for r in requests)
    assert counts["preemptions"] == 0
    assert counts["prefilled"] <= sum(len(r.prompt_ids) for r in requests)  # shared prefixes reused


def test_the_first_request_runs_even_when_it_needs_the_whole_pool() -> None:
    """No deadlock: a request that fits the pool alone (prompt + max_new == the pool) runs when nothing else does,
    though the strict reservation (its tokens + a page < what is free) would refuse it."""
    s = make(65, max_batch_tokens=16)
    whole, after = make_request("whole", 40, 24), make_request("after", 30, 5)
    counts = run(s, arrivals={0: [whole], 1: [after]})
    assert len(whole.output_ids) == 24 and len(after.output_ids) == 5
    assert counts["preemptions"] == 0 and counts["prefilled"] == 70


def test_the_ratio_decays_per_decode_step_is_re_estimated_on_retraction_and_reset_when_idle() -> None:
    ratio = NewTokenRatio.from_conservativeness(1.0)
    assert (ratio.init, ratio.current) == (0.7, 0.7) and ratio.min == pytest.approx(0.7 * 0.14)
    assert NewTokenRatio.from_conservativeness(2.0).init == 1.0  # SGLang caps it at 1
    s = make(101)
    assert s.new_token_ratio.current == 0.7
    a = make_request("a", 10, 60)
    s.add(a)
    s.postprocess(s.schedule(), [70])  # prefill: no decay
    assert s.new_token_ratio.current == 0.7
    for expected in (1, 2, 3):
        step = s.schedule()
        assert step.kind is StepKind.DECODE
        s.postprocess(step, [70])
        assert s.new_token_ratio.current == pytest.approx(0.7 - expected * ratio.decay)
    # the ratio under-reserves: over-committed requests are retracted, and the ratio is SGLang's estimate from the
    # requests left decoding: (tokens they decoded + 20 each) / (their max_new_tokens + 1)
    s.new_token_ratio.current = 0.0
    b = make_request("b", 10, 60)
    s.add(b)
    for _ in range(100):
        step = s.schedule()
        s.postprocess(step, [70] * sum(1 for e in step.entries if e.samples))
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1 and b.num_retractions == 1 and s.running == [a]
    assert s.new_token_ratio.current == pytest.approx(min(1.0, (len(a.output_ids) - 1 + 20) / (60 + 1)))
    run(s)
    assert s.schedule() is None and s.new_token_ratio.current == 0.7  # idle: back to the initial ratio


def test_recomputed_prefill_tokens_for_a_fixed_workload() -> None:
    """The figure the docs quote: 12 requests (prompts of 20..64 tokens, 24..46 new tokens, stop-free), two
    arriving every 4 steps, a 200-slot pool with a prefix cache. Printed with ``-s``."""
    s = make(201, cache=True, max_batch_tokens=64)
    requests = [make_request(f"w{i}", 20 + 4 * i, 24 + 2 * i) for i in range(12)]
    requests = [Request(rid=r.rid, prompt_ids=[65 + i] * len(r.prompt_ids), params=r.params,
                        detokenizer=r.detokenizer, on_output=r.on_output) for i, r in enumerate(requests)]
    counts = run(s, arrivals={4 * i: requests[2 * i:2 * i + 2] for i in range(6)})
    needed = sum(len(r.prompt_ids) for r in requests)
    print(f"\nfixed workload: prefilled {counts['prefilled']} tokens for {needed} of prompts "
          f"({counts['prefilled'] - needed} recomputed), {counts['preemptions']} retractions, "
          f"{counts['decodes']} decode steps")
    assert all(len(r.output_ids) == r.params.max_new_tokens for r in requests)
    assert counts["prefilled"] - needed <= needed // 10

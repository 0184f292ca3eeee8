"""The scheduler, the KV manager, the slot and row allocators and the prefix cache driven by hypothesis through
random sequences of submissions, steps, aborts, failed steps, flushes, retract pauses and ``kv_cache`` release /
resume cycles, with a stand-in model that makes every wrong slot visible.

The stand-in model is CPU bookkeeping too: each step goes through the real ``prefill_inputs`` / ``decode_inputs``
(which fill the request-to-slot table), writes into its KV pool, for each computed position, a hash of the tokens
up to it, then reads back every key the position's attention would read through the table and checks it holds the
hash of that prefix. A slot owned twice, a stale table row, a cached prefix of other tokens or KV kept across a
release all read a wrong key. The token it samples is a function of that hash, so a greedy request's answer is
known beforehand: whether it ran alone, batched, from a cached prefix, preempted or across a release, it must be
that answer (a prefix of it when aborted). Its hidden states are a function of the same hash, so prompt logprobs
(the real ``step_prompt_logprobs``) must come out whole, once each, whatever part of a prompt a cached prefix or a
preemption skipped. After every call the invariants of ``kv_invariants`` hold; every request is answered exactly
once.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.engine import _scores
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.logprobs import prompt_logprobs, step_prompt_logprobs
from node_engine.prefix_cache import PrefixCache
from node_engine.request import FinishReason, Request, RequestState
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.step import Step, StepKind, StepResult
from node_engine.step_inputs import decode_inputs, prefill_inputs
from node_engine.tokenizer import Tokenizer
from tests.node_engine.kv_invariants import check_invariants

TOKENIZER = Tokenizer.builtin_bytes()
EOS = 257
CONTEXT = 48
BASES = ([256, 10, 11, 12, 13, 14, 15, 16, 17], [256, 10, 11, 20, 21], [256, 30])  # shared prefixes


def _key(token_ids: list[int]) -> int:
    """The stand-in KV of a position: a hash of every token up to it (63 bits, never 0: a zeroed pool is wrong)."""
    digest = hashlib.blake2b(repr(token_ids).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) | 1


def _next_token(token_ids: list[int]) -> int:
    """The stand-in model's greedy choice after ``token_ids``: mostly letters, sometimes EOS."""
    key = _key(token_ids)
    return EOS if key % 13 == 0 else 97 + key % 6


def _hidden(token_ids: list[int], positions: range) -> torch.Tensor:
    """The stand-in hidden state [T, 1] of each position: its key, cut to a small float."""
    return torch.tensor([[float(_key(token_ids[:p + 1]) % 1000)] for p in positions])


def _logits(hidden: torch.Tensor) -> torch.Tensor:
    return hidden * torch.arange(EOS + 1, dtype=torch.float32) / 1000


def expected_prompt_logprobs(prompt: list[int], start_len: int) -> list[float]:
    """The prompt logprobs of a request asking for them from ``start_len``, computed in one piece."""
    if not 0 <= start_len < len(prompt) - 1:
        return []
    hidden = _hidden(prompt, range(start_len, len(prompt) - 1))
    return prompt_logprobs(hidden, prompt[start_len + 1:], start_len, LogprobOptions(start_len), _logits).values


def expected_output(prompt: list[int], params: SamplingParams) -> list[int]:
    """What the request answers when it runs alone."""
    ids, out = list(prompt), []
    while len(out) < params.max_new_tokens:
        token = _next_token(ids)
        ids.append(token)
        out.append(token)
        if not params.ignore_eos and (token == EOS or token in params.stop_token_ids):
            break
    return out


class StandInModel:
    """A KV pool and request-to-slot table of the scheduler's sizes; :meth:`run` computes one step."""

    def __init__(self, num_slots: int, num_rows: int) -> None:
        self.kv = torch.zeros(num_slots, dtype=torch.int64)
        self.req_to_token = torch.zeros(num_rows, CONTEXT, dtype=torch.int32)

    def run(self, step: Step) -> StepResult:
        if step.kind is StepKind.PREFILL:
            prefill_inputs(step, self.req_to_token)
        else:
            decode_inputs(step, self.req_to_token)
        written = step.slot_mapping.tolist()
        positions = [p for e in step.entries for p in range(e.start, e.end)]
        requests = [e.request for e in step.entries for _ in range(e.start, e.end)]
        assert len(written) == len(positions), "a step's slots are not one per computed token"
        assert 0 not in written, "a step writes the padding slot"
        assert len(set(written)) == len(written), "a step writes one slot twice"
        self.kv[step.slot_mapping] = torch.tensor([_key(r.token_slice(0, p + 1)) for p, r in zip(positions, requests)])
        tokens = []
        for e in step.entries:
            all_ids = e.request.all_ids
            row = self.req_to_token[e.request.row, :e.end].long()
            read = self.kv[row]  # every key the last computed position attends to
            expected = torch.tensor([_key(all_ids[:p + 1]) for p in range(e.end)])
            wrong = (read != expected).nonzero().view(-1).tolist()
            assert not wrong, (f"request {e.request.rid} reads a wrong key at position {wrong[0]} "
                               f"(slot {row[wrong[0]].item()})")
            if e.samples:
                tokens.append(_next_token(all_ids))
        if step.kind is StepKind.DECODE:
            return StepResult(tokens)
        hidden = torch.cat([_hidden(e.request.all_ids, range(e.start, e.end)) for e in step.entries])
        return StepResult(tokens, None, step_prompt_logprobs(step.entries, hidden, _logits))


def _request(rid: str, prompt: list[int], params: SamplingParams, *, use_cache: bool, prefill: bool,
             logprob_start: int | None) -> Request:
    """As ``Engine.submit`` makes it: with ``max_new_tokens`` 0 it prefills if asked to or for prompt logprobs."""
    logprobs = LogprobOptions(logprob_start) if logprob_start is not None else None
    return Request(rid=rid, prompt_ids=prompt, params=params,
                   detokenizer=IncrementalDetokenizer(TOKENIZER, (), is_lazy=True), on_output=lambda _: None,
                   use_prefix_cache=use_cache, logprobs=logprobs,
                   prefill_only=params.max_new_tokens == 0 and (prefill or _scores(logprobs, len(prompt))))


class SchedulerModel(RuleBasedStateMachine):
    """One engine's CPU bookkeeping, driven the way ``EngineSteps`` and ``EngineControl`` drive it."""

    @initialize(num_slots=st.integers(12, 48), max_running=st.integers(1, 5), max_batch_tokens=st.integers(1, 20),
                with_cache=st.integers(0, 3).map(bool))
    def start(self, num_slots: int, max_running: int, max_batch_tokens: int, with_cache: bool) -> None:
        slots = SlotAllocator(num_slots)
        self.scheduler = Scheduler(SchedulerConfig(max_running_requests=max_running,
                                                   max_batch_tokens=max_batch_tokens, context_len=CONTEXT,
                                                   eos_token_ids=(EOS,)),
                                   slots, RowAllocator(max_running), PrefixCache(slots) if with_cache else None)
        self.model = StandInModel(num_slots, max_running)
        self.requests: list[Request] = []
        self.answers: dict[str, int] = {}  # rid -> final answers seen
        self.failed: set[str] = set()
        self.is_paused = False
        self.is_released = False

    # -- calls ---------------------------------------------------------------------------------------
    @precondition(lambda self: not self.is_released)
    @rule(base=st.sampled_from(BASES), cut=st.sampled_from([2, 4, 9]), tails=st.lists(
              st.lists(st.integers(40, 41), max_size=8), min_size=1, max_size=3),
          max_new=st.integers(0, 24), use_cache=st.integers(0, 4).map(bool), prefill=st.booleans(),
          ignore_eos=st.booleans(), logprob_start=st.none() | st.integers(-1, 12))
    def submit(self, base: list[int], cut: int, tails: list[list[int]], max_new: int, use_cache: bool, prefill: bool,
               ignore_eos: bool, logprob_start: int | None) -> None:
        """Requests sharing a prefix, as ``EngineSteps.admit`` takes them once the gate checked them and capped
        ``max_new_tokens`` to what the pool leaves after the prompt."""
        limit = self.scheduler.max_request_tokens() - 1
        for tail in tails:
            prompt = base[:cut] + tail
            if len(prompt) >= limit - 5:
                continue
            params = SamplingParams(max_new_tokens=min(max_new, limit - len(prompt) - 1), temperature=0.0,
                                    ignore_eos=ignore_eos)
            request = _request(f"r{len(self.requests)}", prompt, params, use_cache=use_cache, prefill=prefill,
                               logprob_start=logprob_start)
            if params.max_new_tokens == 0 and not request.prefill_only:
                continue  # answered at once, never queued
            self.requests.append(request)
            self.scheduler.add(request)

    @precondition(lambda self: not self.is_paused and not self.is_released)
    @rule(num=st.integers(1, 16))
    def step(self, num: int) -> None:
        self.run_steps(num)

    def run_steps(self, num: int) -> bool:
        """Up to ``num`` steps; false once the scheduler plans none."""
        for _ in range(num):
            step = self.scheduler.schedule()
            if step is None:
                return False
            for request in self.scheduler.postprocess(step, self.model.run(step)):
                if request.finish_reason is not None:
                    self._answer(request)
        return True

    @precondition(lambda self: not self.is_paused and not self.is_released)
    @rule(now=st.integers(0, 5))
    def failed_step(self, now: int) -> None:
        """A step whose forward raised (``EngineSteps._fail``): its requests fail, their KV freed, never cached."""
        step = self.scheduler.schedule() if not now else None
        if step is None:
            return
        for request in dict.fromkeys(e.request for e in step.entries):
            self.scheduler.fail(request)
            self.failed.add(request.rid)
            self._answer(request)

    @rule(index=st.integers(0, 200), now=st.integers(0, 2))
    def abort_one(self, index: int, now: int) -> None:
        live = [r for r in self.scheduler.running + list(self.scheduler.waiting)]
        if live and not now:
            self._abort(live[index % len(live)])

    @rule(now=st.integers(0, 3))
    def abort_all(self, now: int) -> None:
        if now:  # rarer than the other calls: it empties the engine
            return
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._abort(request)

    @rule(now=st.integers(0, 3))
    def flush(self, now: int) -> None:
        if self.scheduler.cache is not None and not now:
            self.scheduler.cache.flush()

    @precondition(lambda self: not self.is_paused)
    @rule()
    def pause_retract(self) -> None:
        for request in list(self.scheduler.running):
            self.scheduler.preempt(request, to_back=True)
        self.is_paused = True

    @precondition(lambda self: self.is_paused)
    @rule()
    def continue_generation(self) -> None:
        self.is_paused = False

    @precondition(lambda self: not self.is_released and not self.scheduler.running and (
        self.is_paused or not self.scheduler.waiting))
    @rule()
    def release_kv(self) -> None:
        """``kv_cache`` (and the workspace that follows it) released: its contents are lost."""
        self.model.kv.zero_()
        self.model.req_to_token.zero_()
        self.is_released = True

    @precondition(lambda self: self.is_released)
    @rule()
    def resume_kv(self) -> None:
        """What ``EngineControl._forget_contents`` does for a resumed ``kv_cache``."""
        scheduler = self.scheduler
        scheduler.slots.reset()
        scheduler.rows.reset()
        if scheduler.cache is not None:
            scheduler.cache.reset()
        self.is_released = False

    # -- checks --------------------------------------------------------------------------------------
    def _abort(self, request: Request) -> None:
        self.scheduler.finish(request, FinishReason.ABORT)
        self._answer(request)

    def _answer(self, request: Request) -> None:
        self.answers[request.rid] = self.answers.get(request.rid, 0) + 1
        assert self.answers[request.rid] == 1, f"request {request.rid} answered twice"
        if request.rid in self.failed:
            return
        expected = expected_output(request.prompt_ids, request.params)
        if request.finish_reason is FinishReason.ABORT:
            expected = expected[:len(request.output_ids)]
        assert request.output_ids == expected, (request.rid, request.finish_reason, request.num_retractions)
        if request.logprobs is not None and request.finish_reason is not FinishReason.ABORT:
            got = request.prompt_logprobs.values if request.prompt_logprobs is not None else []
            assert got == pytest.approx(expected_prompt_logprobs(request.prompt_ids, request.logprobs.start_len),
                                        abs=1e-5), f"request {request.rid}'s prompt logprobs"

    @invariant()
    def bookkeeping_is_whole(self) -> None:
        check_invariants(self.scheduler, self.requests)

    def teardown(self) -> None:
        """Everything resumed and continued, run to the end: every request answered once, nothing held."""
        if not hasattr(self, "scheduler"):
            return
        if self.is_released:
            self.resume_kv()
        self.is_paused = False
        while self.run_steps(1):  # every step computes at least one token: this ends
            pass
        scheduler = self.scheduler
        assert not scheduler.has_work, "requests never finish"
        check_invariants(scheduler, self.requests)
        assert all(self.answers.get(r.rid) == 1 for r in self.requests), "a request was never answered"
        assert all(r.state is RequestState.FINISHED for r in self.requests)
        num_cached = scheduler.cache.num_cached_tokens if scheduler.cache is not None else 0
        assert scheduler.slots.num_free + num_cached == scheduler.slots.capacity
        assert scheduler.rows.num_free == scheduler.rows.num_rows


SchedulerModel.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_scheduler_bookkeeping_under_random_calls = pytest.mark.timeout(120)(SchedulerModel.TestCase)

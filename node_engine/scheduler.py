"""Continuous batching with chunked prefill: which tokens to compute next.

Each step either prefills (chunks of prompts, at most ``max_batch_tokens``
tokens, new requests admitted as soon as there is room) or decodes (one token
for every request whose only uncached token is its last sampled one). A
request whose prefill chunk ends exactly one token short simply decodes next:
there is one rule, "compute ``all_ids[num_cached:end]``, sample if ``end`` is
the last token".

A request is admitted only if its whole prompt and the tokens it and the
running requests may still generate fit, as SGLang reserves them
(``token_budget.py``); the first request always runs when nothing else does.
With a prefix cache, an admitted request starts after the longest cached
prefix of its tokens (always leaving its last token to compute), and a
finished request leaves its computed KV to the cache. When slots run short,
unused cached prefixes are evicted first; if that is not enough during
decode, the most recently admitted request is preempted: its KV is freed and
recomputed later; its tokens are kept. The scheduler is CPU bookkeeping only;
it never touches device tensors. A request's slots, row and cached prefix are
its ``KVManager``'s (``kv_manager.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.kv_manager import KVManager
from node_engine.prefix_cache import PrefixCache
from node_engine.request import FinishReason, Request, RequestState
from node_engine.step import Step, StepEntry, StepKind, StepResult
from node_engine.token_budget import NewTokenRatio, PrefillBudget
from node_engine.visual_budget import VisualBudget


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_batch_tokens: int
    context_len: int
    eos_token_ids: tuple[int, ...]
    max_visual_tokens: int = 0  # image tokens the vision tower encodes per step (0: no limit)
    schedule_conservativeness: float = 1.0  # SGLang's: scales the initial new_token_ratio (0.7)

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_batch_tokens", "context_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_visual_tokens < 0:
            raise ValueError(f"max_visual_tokens must be >= 0, got {self.max_visual_tokens}")
        if not self.schedule_conservativeness >= 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, slots: SlotAllocator, rows: RowAllocator,
                 cache: PrefixCache | None = None) -> None:
        self.config = config
        self.kv = KVManager(slots, rows, cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self.new_token_ratio = NewTokenRatio.from_conservativeness(config.schedule_conservativeness)

    @property
    def slots(self) -> SlotAllocator:
        return self.kv.slots

    @property
    def rows(self) -> RowAllocator:
        return self.kv.rows

    @property
    def cache(self) -> PrefixCache | None:
        return self.kv.cache

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self.kv.num_prefix_hit_tokens

    # -- queue -----------------------------------------------------------------
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + new) one request may ever need."""
        return min(self.config.context_len, self.slots.capacity)

    def add(self, request: Request) -> None:
        if request.num_tokens + request.params.max_new_tokens > self.max_request_tokens():
            raise ValueError(f"request {request.rid} was not validated against the context and the pool")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def find(self, rid: str) -> Request | None:
        for request in self.running:
            if request.rid == rid:
                return request
        for request in self.waiting:
            if request.rid == rid:
                return request
        return None

    # -- planning --------------------------------------------------------------
    def schedule(self) -> Step | None:
        while True:
            step = self._schedule_prefill() or self._schedule_decode()
            if step is not None or not self.running:
                return step
            # Partial prefills hold the whole pool and none can go on: make room.
            self.preempt(self.running[-1])

    def _schedule_prefill(self) -> Step | None:
        visual = VisualBudget(self.config.max_visual_tokens)
        entries: list[StepEntry] = []
        budget, decoding = self._continue_prefills(entries, visual)
        reserve = PrefillBudget(self.kv, self.new_token_ratio.current, decoding)
        for request in set(self.running).difference(decoding):  # partial prefills (integer reservations)
            reserve.reserve(request)
        self._admit_waiting(entries, visual, budget, len(decoding), reserve)
        if not entries:
            return None
        slots = [e.slots for e in entries if e.slots is not None]
        slot_mapping = slots[0] if len(slots) == 1 else torch.cat(slots)
        return Step(StepKind.PREFILL, entries, slot_mapping, visual.images)

    def _continue_prefills(self, entries: list[StepEntry], visual: VisualBudget) -> tuple[int, list[Request]]:
        """The next pieces of the running requests' partial prefills, in order; (token budget left, the running
        requests that are decoding)."""
        budget = self.config.max_batch_tokens
        decoding: list[Request] = []
        is_blocked = False  # a partial prefill found no room (or no budget): later ones wait too
        for request in self.running:
            num_uncached = request.num_uncached
            if num_uncached == 1:
                decoding.append(request)
                continue
            if is_blocked or budget == 0:
                continue
            plan = visual.plan(request, request.num_cached, min(num_uncached, budget))
            if plan.num_tokens == 0:  # its next image waits for the next step's budget
                visual.commit(plan)
                continue
            if not self.kv.make_room(plan.num_tokens):
                is_blocked = True
                if plan.images:
                    visual.close()
                continue
            entries.append(self.kv.take(request, plan.num_tokens))
            visual.commit(plan)
            budget -= plan.num_tokens
        return budget, decoding

    def _admit_waiting(self, entries: list[StepEntry], visual: VisualBudget, budget: int,
                       num_decoding: int, reserve: PrefillBudget) -> None:
        """Waiting requests, first come first served, while the token budget, the rows and the KV reservation
        allow; with nothing running the first is admitted if its first chunk fits (no deadlock)."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            if not self.rows.can_allocate() or visual.is_closed:  # an image waits: later arrivals wait behind it
                break
            prefix, node = self.kv.match(request)
            plan = visual.plan(request, prefix.numel(), min(request.num_tokens - prefix.numel(), budget))
            if plan.num_tokens == 0:  # FIFO: nothing after it is admitted before its image
                visual.commit(plan)
                break
            num = plan.num_tokens
            self.kv.lock(node)  # before any eviction can take it (and out of the evictable tokens)
            fits = not self.running or reserve.fits(request, prefix.numel())
            # Leave one decode step's worth of slots to the requests already decoding.
            if not fits or not self.kv.make_room(num + num_decoding):
                self.kv.unlock(node)
                break
            visual.commit(plan)
            self.waiting.popleft()
            self._start_running(request, prefix, node)
            entry = self.kv.take(request, num)
            entry.prefix = prefix if prefix.numel() else None
            entries.append(entry)
            reserve.reserve(request)
            budget -= num

    def _start_running(self, request: Request, prefix: torch.Tensor, node: object | None) -> None:
        """A waiting request gets its row and, with a prefix cache, the cached prefix it matched."""
        request.transition(RequestState.RUNNING)
        self.kv.start(request, prefix, node)
        self.running.append(request)

    def _schedule_decode(self) -> Step | None:
        decoding = [r for r in self.running if r.num_uncached == 1]
        num_preemptions = self.num_preemptions
        while decoding and not self.kv.make_room(len(decoding)):
            victim = self.running[-1]
            self.preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        if not decoding:
            return None
        if self.num_preemptions > num_preemptions:  # SGLang's retract_decode: the ratio from the ones kept
            self.new_token_ratio.after_retraction(decoding)
        else:
            self.new_token_ratio.decay_step()
        slot_mapping, entries = self.kv.take_decode(decoding)
        return Step(StepKind.DECODE, entries, slot_mapping)

    # -- results ---------------------------------------------------------------
    def postprocess(self, step: Step, result: StepResult | Sequence[int]) -> list[Request]:
        """Append sampled tokens (and logprobs), finish requests that are done; returns requests with new output."""
        if not isinstance(result, StepResult):
            result = StepResult(list(result))
        for index, computed in result.prompt_logprobs.items():
            step.entries[index].request.add_prompt_logprobs(computed)
        changed: list[Request] = []
        sampled = [e for e in step.entries if e.samples]
        logprobs = result.logprobs or [None] * len(sampled)
        for entry, token, token_logprobs in zip(sampled, result.tokens, logprobs, strict=True):
            request = entry.request
            if request.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            if request.prefill_only:  # its prompt is computed (and goes to the cache); it generates nothing
                request.scoring_logprobs = token_logprobs  # but answers the top / token_ids row after the prompt
                self.finish(request, FinishReason.LENGTH)
                changed.append(request)
                continue
            request.output_ids.append(token)
            if token_logprobs is not None:
                request.output_logprobs.append(token_logprobs)
            request.detokenizer.add(token)
            reason, matched = self._finish_check(request, token)
            if reason is not None:
                self.finish(request, reason, matched)
            changed.append(request)
        return changed

    def _finish_check(self, request: Request, token: int) -> tuple[FinishReason | None, str | int | None]:
        """SGLang's order: a stop string, then a stop token (none under ``ignore_eos``, which ignores
        ``stop_token_ids`` too), then the length."""
        params = request.params
        if request.detokenizer.matched_stop is not None:
            return FinishReason.STOP, request.detokenizer.matched_stop
        if not params.ignore_eos and (token in self.config.eos_token_ids or token in params.stop_token_set):
            return FinishReason.STOP, token
        if len(request.output_ids) >= params.max_new_tokens or request.num_tokens >= self.config.context_len:
            return FinishReason.LENGTH, None
        return None, None

    # -- lifecycle -------------------------------------------------------------
    def finish(self, request: Request, reason: FinishReason, matched: str | int | None = None) -> None:
        """End a request (any state but finished) and give back its slots and row."""
        was_running = request.state is RequestState.RUNNING
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif was_running:
            self.kv.free(request, keep_in_cache=True)
            self.running.remove(request)
        request.transition(RequestState.FINISHED)
        request.set_finished(reason, matched, was_running=was_running)
        self._reset_ratio_if_idle()
        if request.detokenizer.matched_stop is None:
            # a stop token's text is cut from the answer (its id stays in output_ids), as SGLang does
            request.detokenizer.finish(drop_last=isinstance(matched, int) and not request.params.no_stop_trim)

    def fail(self, request: Request) -> None:
        """End a request whose step raised: its slots and row are freed and its KV, which the failed step may
        have left half written, never goes to the prefix cache."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.RUNNING:
            self.kv.free(request)
            self.running.remove(request)
        request.transition(RequestState.FINISHED)
        self._reset_ratio_if_idle()

    def _reset_ratio_if_idle(self) -> None:
        if not self.has_work:  # idle: SGLang resets new_token_ratio when it has nothing to run
            self.new_token_ratio.reset()

    def preempt(self, request: Request, *, to_back: bool = False) -> None:
        """Back to the waiting queue, its KV freed (recomputed when it runs again): at the front (the pool ran
        out: it goes on first), or with ``to_back`` behind the requests waiting (SGLang's retract pause)."""
        self.kv.free(request)
        self.running.remove(request)
        request.num_cached = 0
        request.num_retractions += 1
        request.transition(RequestState.WAITING)
        if to_back:
            self.waiting.append(request)
        else:
            self.waiting.appendleft(request)
        self.num_preemptions += 1

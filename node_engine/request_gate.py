"""What the event loop checks before a request reaches the engine thread, and the ids in flight.

Rules:

- :meth:`RequestGate.check` answers 400 for a request that can never run on
  this engine (empty prompt, beyond the context, a prompt too long for the
  context or the pool, token ids outside the vocabulary), then 503 while it
  cannot run now (memory released, weights not valid). The cheap length checks
  come first: the scans after them cost the prompt's length. A request it
  takes then has its ``max_new_tokens`` cut to SGLang's bound
  (:meth:`RequestGate.cap_new_tokens`): the context and the pool, less the
  prompt, less two.
- An id is claimed when its request is submitted and given back when its final
  output reaches the event loop, so an abort by id reaches only its own
  request; a second request under an id in flight is 400, as in SGLang.
- The ids an HTTP request will submit later (its ``n`` samples, once their
  shared prompt is prefilled) are held by a :class:`PlannedRequests` from the
  start: a duplicate is refused, and an abort by one of them (or of all)
  marks it aborted, so that sample (or every one) is never run, and only
  that one (SGLang's abort reaches a request it accepted, whatever its stage).

Event-loop side only; the engine thread re-checks :meth:`check_can_generate`
when it admits a request, since memory may be released in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.errors import InvalidRequest, MemoryReleased, WeightsNotLoaded
from node_engine.memory.manager import MemoryManager
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none


class PlannedRequests:
    """Ids an HTTP request holds before it submits them; ``aborted`` holds those an abort named (each of them
    after an abort of all). :meth:`close` (idempotent) gives them back: the run submitted them (claiming each
    first) or ended."""

    def __init__(self, gate: RequestGate, rids: list[str]) -> None:
        self._gate = gate
        self.rids = rids
        self.aborted: set[str] = set()

    def close(self) -> None:
        self._gate.drop_plan(self)


class RequestGate:
    def __init__(self, scheduler: Scheduler, memory: MemoryManager, *, vocab_size: int, context_len: int) -> None:
        self._scheduler = scheduler
        self._memory = memory
        self._vocab_size = vocab_size
        self._context_len = context_len
        self._live_rids: set[str] = set()
        self._planned: dict[str, PlannedRequests] = {}

    def check(self, prompt_ids: list[int], params: SamplingParams, logprobs: LogprobOptions | None = None) -> None:
        """Raise 400 for a request that can never run, 503 while it cannot run now."""
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        self.check_within_context(len(prompt_ids))
        total = len(prompt_ids) + params.max_new_tokens
        if total > self._context_len:  # SGLang's words (TokenizerManager._validate_one_request)
            raise InvalidRequest(
                f"Requested token count exceeds the model's maximum context length of {self._context_len} tokens. "
                f"You requested a total of {total} tokens: {len(prompt_ids)} tokens from the input messages and "
                f"{params.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit.")
        limit = self.max_input_tokens()
        if len(prompt_ids) >= limit:  # SGLang's scheduler (validate_input_length), in its words
            raise InvalidRequest(f"Input length ({len(prompt_ids)} tokens) exceeds the maximum allowed length "
                                 f"({limit} tokens). Use a shorter input.")
        self._check_ids("token ids", prompt_ids)
        self._check_ids("stop_token_ids", params.stop_token_ids)
        if logprobs is not None:
            self._check_ids("token_ids_logprob", logprobs.token_ids or ())
            if logprobs.top_logprobs_num > self._vocab_size:  # SGLang's top-k past the vocabulary fails
                raise InvalidRequest(f"top_logprobs_num ({logprobs.top_logprobs_num}) is more than the "
                                     f"vocabulary ({self._vocab_size} tokens)")
        self.check_can_generate()

    def check_within_context(self, num_prompt_tokens: int) -> None:
        """SGLang's first rule (``TokenizerManager._validate_one_request``), whatever ``max_new_tokens`` says."""
        if num_prompt_tokens >= self._context_len:
            raise InvalidRequest(f"The input ({num_prompt_tokens} tokens) is longer than the model's context "
                                 f"length ({self._context_len} tokens).")

    def max_input_tokens(self) -> int:
        """SGLang's ``max_req_input_len``: ``max_req_len`` (the context and the pool, less one; tp_worker.py
        ``get_worker_info``) less five. A prompt of this length or longer is refused."""
        return self._max_req_len() - 5

    def cap_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_new_tokens`` (and ``min_new_tokens``) cut to what SGLang's scheduler lets a
        request generate, for a request :meth:`check` took: ``max_req_len - prompt - 1``
        (``Scheduler.init_req_max_new_tokens``; the pool's own bound, ``max_new_tokens_for_memory``, is
        ``pool - prompt - 2``, the same). The sequence then ends on its length at the cut."""
        room = max(0, self._max_req_len() - num_prompt_tokens - 1)
        if params.max_new_tokens <= room:
            return params
        return replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))

    def _max_req_len(self) -> int:
        return self._scheduler.max_request_tokens() - 1

    def _check_ids(self, what: str, ids: Sequence[int]) -> None:
        vocab = self._vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"{what} out of range [0, {vocab}): {bad[:5]}")

    def check_can_generate(self) -> None:
        released = self._memory.released_tags()
        if released:
            raise MemoryReleased(f"memory is released ({', '.join(t.value for t in released)}); resume it first",
                                 retry_after=1, extra={"released": [t.value for t in released]})
        if not self._memory.weights_valid:
            raise WeightsNotLoaded("the weights are not a checkpoint's (resumed without a backup, or reset by "
                                   "/weights_checker); update them first (/update_weights_from_disk, a push or a "
                                   "broadcast)")

    def check_rids_free(self, rids: list[str]) -> None:
        """400 if one of ``rids`` is a request still in flight (or planned)."""
        taken = [rid for rid in rids if self.is_live(rid)]
        if taken:
            raise _duplicate(taken[0])

    def is_live(self, rid: str) -> bool:
        return rid in self._live_rids or rid in self._planned

    def claim(self, rid: str) -> None:
        """Hold ``rid`` for a request being submitted; an id in flight is never held twice (400), whatever path
        submits it, so an abort or a final output can only ever name one request."""
        if rid in self._live_rids:
            raise _duplicate(rid)
        self._live_rids.add(rid)

    def give_back(self, rid: str) -> None:
        self._live_rids.discard(rid)

    def plan(self, rids: list[str]) -> PlannedRequests:
        """Hold ``rids`` for requests to be submitted later (400 if one is taken)."""
        self.check_rids_free(rids)
        planned = PlannedRequests(self, rids)
        self._planned.update((rid, planned) for rid in rids)
        return planned

    def abort_planned(self, rid: str | None) -> None:
        """An abort of ``rid`` (None: all) reaches the request planned under it too, and only that one."""
        if rid is None:
            for planned in set(self._planned.values()):
                planned.aborted.update(planned.rids)
        elif rid in self._planned:
            self._planned[rid].aborted.add(rid)

    def drop_plan(self, planned: PlannedRequests) -> None:
        for rid in planned.rids:
            if self._planned.get(rid) is planned:
                del self._planned[rid]

    def room_after(self, num_prompt_tokens: int) -> int:
        """What a request without a limit (``max_new_tokens`` null, or a chat without one) asks for: what the
        context leaves, which SGLang's context check never refuses; :meth:`cap_new_tokens` then cuts it."""
        return max(0, self._context_len - num_prompt_tokens)

    def default_max_new_tokens(self, num_prompt_tokens: int) -> int:
        """``/generate``'s default of 128 where the context leaves that much (SGLang checks no total for a
        ``max_new_tokens`` left out); :meth:`cap_new_tokens` then cuts it."""
        return min(DEFAULT_MAX_NEW_TOKENS, self.room_after(num_prompt_tokens))

def _duplicate(rid: str) -> InvalidRequest:
    """SGLang's words for an id in flight (``TokenizerManager``: "Duplicate request ID detected")."""
    return InvalidRequest(f"Duplicate request ID detected: {rid[:200]!r} is already in flight")

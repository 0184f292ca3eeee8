"""The KV admission budget of one prefill step, SGLang's ``PrefillAdder`` / ``PrefillBudget`` (page size 1), and its
``new_token_ratio`` (``NewTokenRatioTracker``). CPU bookkeeping only.

A waiting request is admitted only if its whole uncomputed prompt, ``min(max_new_tokens left, CLIP)`` and one page
fit in what is free or evictable, less what is reserved already: for every request decoding, ``min(its tokens
left, CLIP) * new_token_ratio`` (1 under ``ignore_eos``: it will use them all); for every request admitted or
continued this step, the rest of its prompt, one page and its whole ``min(left, CLIP)``. The ratio is SGLang's
guess of the share of ``max_new_tokens`` a request really generates: ``min(0.7 * schedule_conservativeness, 1)``
at first, down by ``(init - min) / 600`` per decode step to ``init * 0.14``, re-estimated from the requests left
decoding after a retraction, back to its first value when the engine is idle.

Slots a step takes are allocated as it is planned (``KVManager.take``), so they are off ``num_free`` already and
are not reserved again here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from node_engine.kv_manager import KVManager
from node_engine.request import Request

CLIP_MAX_NEW_TOKENS = 4096        # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7        # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20          # SGLANG_RETRACT_DECODE_STEPS
PAGE_SIZE = 1                      # the page SGLang reserves per admitted request (alignment overhead)


@dataclass
class NewTokenRatio:
    init: float
    min: float
    decay: float
    current: float

    @classmethod
    def from_conservativeness(cls, schedule_conservativeness: float) -> NewTokenRatio:
        init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        low = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        return cls(init=init, min=low, decay=(init - low) / NEW_TOKEN_RATIO_DECAY_STEPS, current=init)

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        self.current = self.init

    def after_retraction(self, kept: Iterable[Request]) -> None:
        """SGLang's estimate from the requests left decoding: (their decoded tokens + 20 each) / (their
        ``max_new_tokens`` + 1), at most 1."""
        kept = list(kept)
        decoded = sum(len(r.output_ids) for r in kept)
        max_new = sum(r.params.max_new_tokens for r in kept)
        self.current = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (max_new + 1))


def tokens_left(request: Request) -> int:
    """The new tokens a request may still generate, clipped as SGLang clips its estimate."""
    if request.prefill_only:
        return 0
    return min(max(request.params.max_new_tokens - len(request.output_ids), 0), CLIP_MAX_NEW_TOKENS)


class PrefillBudget:
    """What one prefill step may still admit. ``reserved`` counts the tokens promised to requests and not yet
    allocated; ``num_free`` and the cache's evictable tokens are read live (a lock taken or an eviction made
    counts at once)."""

    def __init__(self, kv: KVManager, ratio: float, decoding: Iterable[Request]) -> None:
        self.kv = kv
        self.reserved = 0.0
        for request in decoding:
            self.reserved += tokens_left(request) * (1.0 if request.params.ignore_eos else ratio)

    @property
    def remaining(self) -> float:
        cache = self.kv.cache
        evictable = cache.num_evictable_tokens if cache is not None else 0
        return self.kv.slots.num_free + evictable - self.reserved

    def fits(self, request: Request, num_prefix: int) -> bool:
        """Whether a waiting request (its matched prefix locked) can be admitted: all it still needs, strictly less
        than what remains (SGLang's ``total_tokens < rem_total_tokens``)."""
        return request.num_tokens - num_prefix + tokens_left(request) + PAGE_SIZE < self.remaining

    def reserve(self, request: Request) -> None:
        """A request admitted or continued this step, its chunk taken: the rest of its prompt, a page and its tokens
        left are promised to it."""
        self.reserved += request.num_uncached + PAGE_SIZE + tokens_left(request)

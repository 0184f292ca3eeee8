"""A running request's KV, CPU bookkeeping only: the cached prefix it reuses, the slots each step takes, its row of
the request-to-slot table, and where they go when it leaves (the prefix cache, or free).

The scheduler decides which requests run; this is where their slots, rows and prefix-cache locks are taken and given
back, and where unused cached prefixes are evicted to make room.
"""

from __future__ import annotations

import torch

from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.prefix_cache import PrefixCache
from node_engine.request import Request
from node_engine.step import StepEntry

_NO_PREFIX = torch.empty(0, dtype=torch.int64)


class KVManager:
    def __init__(self, slots: SlotAllocator, rows: RowAllocator, cache: PrefixCache | None = None) -> None:
        self.slots = slots
        self.rows = rows
        self.cache = cache
        self.num_prefix_hit_tokens = 0

    def match(self, request: Request) -> tuple[torch.Tensor, object | None]:
        """The cached prefix a waiting request can reuse (its last token is always computed)."""
        if self.cache is None or not request.use_prefix_cache:
            return _NO_PREFIX, None
        end = request.num_tokens - 1
        pending = request.prompt_logprob_next  # positions whose logits prompt logprobs still need
        if pending is not None:
            end = min(end, pending)
        prefix, node = self.cache.match(request.key_slice(0, end))
        return prefix, (node if prefix.numel() else None)

    def lock(self, node: object | None) -> None:
        """Keep a matched prefix from eviction (``None``: no prefix matched)."""
        if node is not None:
            self.cache.lock(node)  # type: ignore[union-attr]

    def unlock(self, node: object | None) -> None:
        if node is not None:
            self.cache.unlock(node)  # type: ignore[union-attr]

    def make_room(self, num: int) -> bool:
        """Whether ``num`` slots can be allocated, evicting unused cached prefixes if that is what it takes.

        Checked before anything is evicted: room that eviction cannot make leaves the cache as it was.
        """
        if self.slots.can_allocate(num):
            return True
        if self.cache is None or num > self.slots.num_free + self.cache.num_evictable_tokens:
            return False
        self.cache.evict(num - self.slots.num_free)
        return self.slots.can_allocate(num)

    def start(self, request: Request, prefix: torch.Tensor, node: object | None) -> None:
        """A request that starts running gets its row and, with a prefix cache, the cached prefix it matched."""
        request.row = self.rows.allocate()
        if self.cache is not None:
            request.prefix_node = node
            request.prefix_slots = prefix
            request.cache_epoch = self.cache.epoch
            request.num_cached = prefix.numel()
            if not request.num_retractions:
                request.num_cached_prompt_tokens = min(prefix.numel(), len(request.prompt_ids))
            self.num_prefix_hit_tokens += prefix.numel()

    def take(self, request: Request, num: int) -> StepEntry:
        """The slots of the next ``num`` tokens of a request's prefill."""
        if request.decode_slots:
            raise RuntimeError(f"request {request.rid} prefills after it began decoding")
        start = request.num_cached
        slots = self.slots.allocate(num)
        request.slots.append(slots)
        request.num_cached += num
        return StepEntry(request, start, start + num, slots)

    def take_decode(self, decoding: list[Request]) -> tuple[torch.Tensor, list[StepEntry]]:
        """One slot for each decoding request: one allocation for the whole step; each request records its slot as
        a plain int."""
        slot_mapping = self.slots.allocate(len(decoding))
        entries = []
        for request, slot in zip(decoding, slot_mapping.tolist(), strict=True):
            start = request.num_cached
            request.decode_slots.append(slot)
            request.num_cached = start + 1
            entries.append(StepEntry(request, start, start + 1, None))
        return slot_mapping, entries

    def free(self, request: Request, *, keep_in_cache: bool = False) -> None:
        """Give back a request's slots and row; with ``keep_in_cache``, its computed KV goes to the prefix cache."""
        own = request.take_slots()
        cache = self.cache
        if own is not None:
            if keep_in_cache and cache is not None and request.cache_epoch == cache.epoch and request.use_prefix_cache:
                prefix = request.prefix_slots if request.prefix_slots is not None else _NO_PREFIX
                num_prefix = prefix.numel()
                num_cached_before = cache.insert(request.key_slice(0, request.num_cached), torch.cat([prefix, own]))
                if num_cached_before > num_prefix:  # someone cached the same tokens meanwhile: ours are spares
                    self.slots.free(own[:num_cached_before - num_prefix])
            else:
                self.slots.free(own)
        if request.prefix_node is not None and cache is not None:
            cache.unlock(request.prefix_node)
        request.prefix_node = None
        request.prefix_slots = None
        if request.row is not None:
            self.rows.free(request.row)
            request.row = None
        if request.mm is not None:  # a preempted request re-encodes its images; a finished one needs nothing
            request.mm.forget_features()

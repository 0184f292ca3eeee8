"""The KV manager, the prefix cache and the slot and row allocators against a reference model, by seeded random
operations (plain ``random``, a fixed number of seeds and operations: the same run every time).

The reference is a dict per cached token position: the token ids up to it → its slot, plus the slots each user
owns and the positions each user reuses (locks). Users are real :class:`Request` objects driven through
:class:`KVManager` the way the scheduler drives it (match, lock, make room, start, prefill chunks, decode slots,
free to the cache or not, preemption and a later run from the start with the tokens kept), between flushes,
evictions and resets (the pool resumed empty). After every operation:

- the radix tree, flattened, is exactly the reference's live entries (same keys, same slots);
- a match agrees with the reference's longest cached prefix, slot for slot;
- every slot is free, owned by one user, held by a live entry, or by a flushed entry still in use (never two);
- the counts the cache keeps (cached, evictable) and the allocators' free counts are the reference's;
- an eviction frees only unlocked entries, keeps the tree prefix-closed, and frees what it reports.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.kv_manager import KVManager
from node_engine.prefix_cache import PrefixCache, _Node
from node_engine.request import Request
from node_engine.sampling import SamplingParams
from node_engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)

TOKENIZER = Tokenizer.builtin_bytes()
NUM_SEEDS = 24
NUM_OPS = 400


@dataclass
class User:
    """A running request as the reference sees it."""

    request: Request
    num_prefix: int                    # leading positions reused from the cache (locked)
    epoch: int                         # the cache's epoch when it started
    own: list[int] = field(default_factory=list)  # its slots, in token order after the prefix


def _tree(cache: PrefixCache) -> dict[tuple[int, ...], int]:
    """The live tree flattened: the token ids up to each cached position → its slot."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[_Node, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            assert child.parent is node, "a child does not point back at its parent"
            assert child.slots.numel() == len(child.key) > 0, "an entry's slots are not one per token"
            keys = path
            for token, slot in zip(child.key, child.slots.tolist(), strict=True):
                keys = keys + (token,)
                assert keys not in out
                out[keys] = slot
            stack.append((child, keys))
    return out


class Harness:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.num_slots = rng.randint(8, 40)
        self.num_rows = rng.randint(1, 5)
        self.slots = SlotAllocator(self.num_slots)
        self.rows = RowAllocator(self.num_rows)
        self.cache = PrefixCache(self.slots)
        self.kv = KVManager(self.slots, self.rows, self.cache)
        self.users: list[User] = []
        self.preempted: list[Request] = []
        self.live: dict[tuple[int, ...], int] = {}        # reference: the live tree
        self.detached: dict[int, int] = {}                # flushed slots still in use → their users
        self.detached_users: dict[int, set[int]] = {}     # id(user request) → detached slots it reuses
        self.serial = 0

    # -- reference ---------------------------------------------------------------------------
    def ref_match(self, keys: list[int]) -> list[int]:
        out = []
        for i in range(len(keys)):
            slot = self.live.get(tuple(keys[:i + 1]))
            if slot is None:
                break
            out.append(slot)
        return out

    def locked_keys(self) -> set[tuple[int, ...]]:
        locked = set()
        for user in self.users:
            if id(user.request) in self.detached_users:
                continue
            keys = user.request.key_slice(0, user.num_prefix)
            locked.update(tuple(keys[:i + 1]) for i in range(user.num_prefix))
        return locked

    # -- operations --------------------------------------------------------------------------
    def admit(self) -> None:
        if not self.rows.can_allocate():
            return
        rng = self.rng
        if self.preempted and rng.random() < 0.5:  # a preempted request runs again, its outputs kept
            request = self.preempted.pop(0)
        else:
            length = rng.randint(1, min(12, self.num_slots - 1))
            prompt = [rng.choice((1, 2, 3)) if rng.random() < 0.8 else rng.randint(4, 9) for _ in range(length)]
            self.serial += 1
            request = Request(rid=f"r{self.serial}", prompt_ids=prompt,
                              params=SamplingParams(max_new_tokens=8, temperature=0.0),
                              detokenizer=IncrementalDetokenizer(TOKENIZER, (), is_lazy=True),
                              on_output=lambda _: None, use_prefix_cache=rng.random() < 0.85)
        if request.num_tokens >= self.num_slots:
            return  # its KV can no longer fit the pool (the scheduler's requests are capped below it)
        prefix, node = self.kv.match(request)
        expected = self.ref_match(request.key_slice(0, request.num_tokens - 1)) if request.use_prefix_cache else []
        assert prefix.tolist() == expected, "a match is not the longest cached prefix"
        num = request.num_tokens - prefix.numel()
        first = rng.randint(1, num)  # the first chunk; the rest come with prefill()
        self.kv.lock(node)
        keys = request.key_slice(0, prefix.numel())
        evictable_before = self.evictable_ref({tuple(keys[:i + 1]) for i in range(len(keys))})
        free_before = self.slots.num_free
        if not self.kv.make_room(first):
            self.kv.unlock(node)
            assert first > free_before + evictable_before, "room was refused that eviction could have made"
            assert _tree(self.cache) == self.live, "room refused after evicting for it"
            return
        self.sync_after_evict()
        self.kv.start(request, prefix, node)
        user = User(request, prefix.numel(), self.cache.epoch)
        self.users.append(user)
        self.chunk(user, first)

    def chunk(self, user: User, num: int) -> None:
        free = set(self.free_slots())
        entry = self.kv.take(user.request, num)
        taken = entry.slots.tolist()
        assert len(taken) == num and set(taken) <= free and 0 not in taken
        assert entry.start == user.num_prefix + len(user.own)
        user.own += taken

    def prefill(self) -> None:
        pending = [u for u in self.users if u.request.num_uncached > 1]
        if not pending:
            return
        user = self.rng.choice(pending)
        num = self.rng.randint(1, user.request.num_uncached - 1)
        if self.kv.make_room(num):
            self.sync_after_evict()
            self.chunk(user, num)
        self.sync_after_evict()

    def decode(self) -> None:
        for user in self.users:  # a computed last token samples the next one
            request = user.request
            if request.num_uncached == 0:
                request.output_ids.append(self.rng.choice((1, 2, 3)))
        decoding = [u for u in self.users if u.request.num_uncached == 1]
        if not decoding or not self.kv.make_room(len(decoding)):
            self.sync_after_evict()
            return
        self.sync_after_evict()
        free = set(self.free_slots())
        slot_mapping, entries = self.kv.take_decode([u.request for u in decoding])
        assert set(slot_mapping.tolist()) <= free and len(set(slot_mapping.tolist())) == len(decoding)
        for user, slot in zip(decoding, slot_mapping.tolist(), strict=True):
            user.own.append(slot)

    def preempt(self) -> None:
        """Back to waiting (``Scheduler.preempt``): its KV freed, never cached; its tokens kept."""
        if not self.users:
            return
        user = self.users[self.rng.randrange(len(self.users))]
        self.finish(False, user)
        user.request.num_cached = 0
        self.preempted.append(user.request)

    def finish(self, keep: bool, user: User | None = None) -> None:
        if not self.users:
            return
        user = user or self.users[self.rng.randrange(len(self.users))]
        self.users.remove(user)
        request = user.request
        cached_now = keep and request.use_prefix_cache and user.epoch == self.cache.epoch
        if cached_now:
            keys = request.key_slice(0, request.num_cached)
            slots = self.ref_match(keys[:user.num_prefix])
            assert len(slots) == user.num_prefix, "a locked prefix left the tree"
            for i, slot in enumerate(user.own, start=user.num_prefix):
                self.live.setdefault(tuple(keys[:i + 1]), slot)
        self.kv.free(request, keep_in_cache=keep)
        assert request.row is None and request.prefix_node is None and not request.num_owned_slots
        detached = self.detached_users.pop(id(request), set())
        for slot in detached:
            self.detached[slot] -= 1
            if not self.detached[slot]:
                del self.detached[slot]

    def flush(self) -> None:
        for user in self.users:
            if id(user.request) in self.detached_users:
                continue
            keys = user.request.key_slice(0, user.num_prefix)
            slots = {self.live[tuple(keys[:i + 1])] for i in range(user.num_prefix)}
            self.detached_users[id(user.request)] = slots
            for slot in slots:
                self.detached[slot] = self.detached.get(slot, 0) + 1
        dropped = self.cache.flush()
        assert dropped == len(self.live), "a flush reports tokens it did not drop (or the reverse)"
        self.live = {}

    def evict(self) -> None:
        want = self.rng.randint(1, self.num_slots)
        locked = self.locked_keys()
        evictable = self.evictable_ref()
        before = dict(self.live)
        freed = self.cache.evict(want)
        self.sync_after_evict()
        gone = set(before) - set(self.live)
        assert not gone & locked, "an eviction took a locked entry"
        assert freed == len(gone)
        assert freed >= min(want, evictable), "an eviction freed less than it could"

    def reset(self) -> None:
        if self.users:
            return
        self.slots.reset()
        self.rows.reset()
        self.cache.reset()
        self.live = {}
        assert not self.detached

    # -- checks ------------------------------------------------------------------------------
    def evictable_ref(self, also_locked: set[tuple[int, ...]] | None = None) -> int:
        locked = self.locked_keys() | (also_locked or set())
        return len(self.live) - len(locked & set(self.live))

    def free_slots(self) -> list[int]:
        return [s for chunk in self.slots._free_chunks for s in chunk.tolist()]

    def sync_after_evict(self) -> None:
        """Whatever eviction took leaves the reference too (checked against the tree in :meth:`check`)."""
        tree = _tree(self.cache)
        gone = set(self.live) - set(tree)
        self.live = {k: v for k, v in self.live.items() if k not in gone}
        for keys in self.live:
            assert keys[:-1] in self.live or len(keys) == 1, "the cache is not prefix-closed"

    def check(self) -> None:
        assert _tree(self.cache) == self.live, "the radix tree is not the reference's cache"
        free = self.free_slots()
        owned = [s for u in self.users for s in u.own]
        for user in self.users:
            assert user.request.num_owned_slots == len(user.own)
            assert user.request.num_cached == user.num_prefix + len(user.own)
        every = free + owned + list(self.live.values()) + list(self.detached)
        assert len(every) == len(set(every)), "a KV slot has two owners"
        assert sorted(every) == list(range(1, self.num_slots)), "a KV slot leaked"
        assert self.slots.num_free == len(free)
        assert self.cache.num_cached_tokens == len(self.live) + len(self.detached)
        assert self.cache.num_evictable_tokens == self.evictable_ref()
        rows = self.rows._free + [u.request.row for u in self.users]
        assert sorted(rows) == list(range(self.num_rows)), "a request row leaked"


OPS = ("admit", "admit", "admit", "prefill", "prefill", "decode", "decode", "finish_keep", "finish_keep", "finish",
       "preempt", "flush", "evict", "reset")


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_kv_bookkeeping_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    harness = Harness(rng)
    for _ in range(NUM_OPS):
        op = rng.choice(OPS)
        if op == "finish_keep":
            harness.finish(True)
        elif op == "finish":
            harness.finish(False)
        else:
            getattr(harness, op)()
        harness.check()
    while harness.users:
        harness.finish(rng.random() < 0.7)
        harness.check()
    assert harness.cache.num_cached_tokens + harness.slots.num_free == harness.slots.capacity
    assert harness.cache.num_evictable_tokens == harness.cache.num_cached_tokens
    assert harness.rows.num_free == harness.num_rows

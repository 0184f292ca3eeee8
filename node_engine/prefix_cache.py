"""The prefix cache: KV of finished requests, kept by token ids in a radix tree, reused by later ones.

Rules:
- :meth:`PrefixCache.match` finds the longest cached prefix of a token list;
  the request that uses it :meth:`lock`\\ s it, so it cannot be evicted, and
  :meth:`unlock`\\ s it when done.
- :meth:`insert` hands a finished request's computed KV to the cache; the
  leading tokens the cache already held are reported, so the caller frees its
  own duplicate slots.
- :meth:`evict` frees the least recently used unlocked leaves until enough
  slots are free; entries in use are never evicted.
- :meth:`flush` drops everything at once. Entries locked by running requests
  are detached with the old tree: never matched again, freed when their last
  user unlocks them. Requests admitted before a flush (an older ``epoch``)
  never insert: their KV may come from old weights. A flush never fails and
  never waits.
- :meth:`reset` forgets everything without freeing slots, for when the slot
  allocator itself was reset (the KV pool was resumed empty).

CPU bookkeeping only: slot ids are CPU tensors; the KV itself lives in the
runner's pool.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from node_engine.kv_cache import SlotAllocator


_SERIALS = itertools.count()  # a node's creation order: eviction's tie-break, the same from one run to the next


class _Node:
    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_use", "is_detached", "serial")

    def __init__(self, key: tuple[int, ...], slots: torch.Tensor, parent: "_Node | None") -> None:
        self.key = key
        self.slots = slots
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_use = 0
        self.is_detached = False  # flushed while locked: freed when the last user unlocks it
        self.serial = next(_SERIALS)


def _common_length(a: tuple[int, ...], b: list[int], offset: int) -> int:
    n = min(len(a), len(b) - offset)
    i = 0
    while i < n and a[i] == b[offset + i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, slots: SlotAllocator) -> None:
        self.slots = slots
        self._root = _Node((), torch.empty(0, dtype=torch.int64), None)
        self._clock = itertools.count(1)
        self.num_cached_tokens = 0   # tokens whose slots the cache holds (detached ones included)
        self._num_detached_tokens = 0  # of which in detached entries (dropped by a flush, still in use)
        self._num_locked_tokens = 0  # of which in locked entries of the tree (not detached)
        self.epoch = 0               # bumped by every flush and reset

    @property
    def root(self) -> _Node:
        return self._root

    def match(self, token_ids: list[int]) -> tuple[torch.Tensor, _Node]:
        """The slots of the longest cached prefix of ``token_ids``, and the node it ends in."""
        path, _ = self._walk(token_ids)
        parts = [node.slots for node in path]
        slots = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else self._root.slots
        return slots, path[-1] if path else self._root

    def _walk(self, token_ids: list[int]) -> tuple[list[_Node], int]:
        """The nodes along the longest cached prefix (edges split to end exactly there), and its length.

        Marks them used now, for the LRU order of eviction.
        """
        node = self._root
        path: list[_Node] = []
        offset = 0
        now = next(self._clock)
        while offset < len(token_ids):
            child = node.children.get(token_ids[offset])
            if child is None:
                break
            num = _common_length(child.key, token_ids, offset)
            if num < len(child.key):
                child = self._split(child, num)
            child.last_use = now
            path.append(child)
            offset += num
            node = child
        return path, offset

    def _split(self, node: _Node, num: int) -> _Node:
        """Cut ``node``'s edge after ``num`` tokens; returns the new upper part."""
        if node.parent is None:
            raise RuntimeError("the prefix cache's root is never split")
        upper = _Node(node.key[:num], node.slots[:num], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_use = node.last_use
        upper.is_detached = node.is_detached
        node.parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[num:], node.slots[num:], upper
        upper.children[node.key[0]] = node
        return upper

    def lock(self, node: _Node) -> None:
        while node.parent is not None:  # up to the root of whichever tree it is in
            node.lock_ref += 1
            if node.lock_ref == 1 and not node.is_detached:
                self._num_locked_tokens += node.slots.numel()
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and not node.is_detached:
                self._num_locked_tokens -= node.slots.numel()
            parent = node.parent
            if node.is_detached and node.lock_ref == 0 and not node.children:
                self._drop(node)
            node = parent

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Cache ``slots`` as the KV of ``token_ids``; returns how many leading tokens were cached already."""
        if len(token_ids) != slots.numel():
            raise ValueError(f"one slot per token: {len(token_ids)} tokens, {slots.numel()} slots")
        path, offset = self._walk(token_ids)
        node = path[-1] if path else self._root
        if offset < len(token_ids):
            leaf = _Node(tuple(token_ids[offset:]), slots[offset:], node)
            leaf.last_use = next(self._clock)
            node.children[leaf.key[0]] = leaf
            self.num_cached_tokens += leaf.slots.numel()
        return offset

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, oldest first; returns slots freed."""
        leaves = [(n.last_use, n.serial, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        num_freed = 0
        while leaves and num_freed < num_tokens:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            num_freed += node.slots.numel()
            self._drop(node)
            if parent is not self._root and parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_use, parent.serial, parent))
        return num_freed

    def flush(self) -> int:
        """Drop every cached prefix; returns the tokens dropped (in-use ones are freed when unlocked)."""
        num_before = self.num_cached_tokens - self._num_detached_tokens  # an earlier flush dropped those
        self.evict(self.num_cached_tokens)
        for node in self._nodes():  # still locked: detached with the old root, freed on their last unlock
            node.is_detached = True
            self._num_detached_tokens += node.slots.numel()
        self._root = _Node((), self._root.slots, None)
        self._num_locked_tokens = 0
        self.epoch += 1
        return num_before

    def reset(self) -> None:
        """Forget every entry without freeing slots (the slot allocator was reset); nothing may be locked."""
        if any(n.lock_ref for n in self._nodes()):
            raise RuntimeError("the prefix cache was reset with prefixes in use")
        old, self._root = self._root, _Node((), self._root.slots, None)
        # The old root lets go of its tree, so its nodes (each pointing back up) and their slot tensors are freed
        # now rather than by the cycle collector's next pass, or never if the root is frozen out of it (gc.freeze)
        old.children = {}
        self.num_cached_tokens = 0
        self._num_detached_tokens = 0
        self._num_locked_tokens = 0
        self.epoch += 1

    @property
    def num_evictable_tokens(self) -> int:
        """What :meth:`evict` can free: the tree's unlocked entries (a locked one's ancestors are locked too). A
        count kept up to date: it is read on every admission the pool refuses, with a tree of any size."""
        return self.num_cached_tokens - self._num_detached_tokens - self._num_locked_tokens

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _drop(self, node: _Node) -> None:
        parent = node.parent
        if parent is None or node.children or node.lock_ref:
            raise RuntimeError("only free leaves of the prefix cache are dropped")
        del parent.children[node.key[0]]
        self.slots.free(node.slots)
        self.num_cached_tokens -= node.slots.numel()
        if node.is_detached:
            self._num_detached_tokens -= node.slots.numel()
        node.parent = None

"""Bookkeeping of the KV pool: token slots and request rows.

Both allocators split checking from committing (``can_allocate`` /
``allocate``), so the scheduler can plan a step without side effects. They
hold CPU tensors and lists only; the device tensors they index live in the
runner. Slot 0 is never handed out: it is the padding slot that padded
attention indices point at.
"""

from __future__ import annotations

import torch

PADDING_SLOT = 0


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    """Token slots ``1..num_slots-1`` of the KV pool."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2, got {num_slots}")
        self.num_slots = num_slots
        self._free_chunks: list[torch.Tensor] = [torch.arange(1, num_slots, dtype=torch.int64)]
        self._num_free = num_slots - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity(self) -> int:
        """Slots a request can ever use (the padding slot excluded)."""
        return self.num_slots - 1

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    def can_allocate(self, num: int) -> bool:
        return num <= self._num_free

    def allocate(self, num: int) -> torch.Tensor:
        if num > self._num_free:
            raise OutOfSlots(f"asked for {num} slots, {self._num_free} free")
        if num == 0:
            return torch.empty(0, dtype=torch.int64)
        if len(self._free_chunks) > 1:
            self._free_chunks = [torch.cat(self._free_chunks)]
        free = self._free_chunks[0]
        taken, self._free_chunks[0] = free[:num], free[num:]
        self._num_free -= num
        return taken

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free_chunks.append(slots)
            self._num_free += slots.numel()

    def reset(self) -> None:
        self.__init__(self.num_slots)  # type: ignore[misc]


class RowAllocator:
    """Rows of the request-to-slot table, one per running request."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots("no free request row")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)

    def reset(self) -> None:
        self.__init__(self.num_rows)  # type: ignore[misc]

from __future__ import annotations

import pytest
import torch

from node_engine.kv_cache import PADDING_SLOT, OutOfSlots, RowAllocator, SlotAllocator


def test_slots_check_does_not_commit() -> None:
    slots = SlotAllocator(9)
    assert slots.capacity == 8
    assert slots.can_allocate(8) and not slots.can_allocate(9)
    assert slots.num_free == 8  # checking took nothing


def test_slots_never_hand_out_padding_and_come_back() -> None:
    slots = SlotAllocator(9)
    a = slots.allocate(5)
    b = slots.allocate(3)
    taken = torch.cat([a, b]).tolist()
    assert PADDING_SLOT not in taken and len(set(taken)) == 8
    assert not slots.can_allocate(1)
    with pytest.raises(OutOfSlots):
        slots.allocate(1)
    slots.free(a)
    assert slots.num_free == 5 and slots.num_used == 3
    again = slots.allocate(5)
    assert sorted(again.tolist()) == sorted(a.tolist())
    slots.reset()
    assert slots.num_free == 8


def test_rows() -> None:
    rows = RowAllocator(2)
    r1, r2 = rows.allocate(), rows.allocate()
    assert {r1, r2} == {0, 1} and not rows.can_allocate()
    with pytest.raises(OutOfSlots):
        rows.allocate()
    rows.free(r1)
    assert rows.allocate() == r1

"""The engine's staging slot (:mod:`node_engine.weight_sync.staging`), in process so the interleavings are exact:
a wait bounded by the caller's deadline, and a slot never kept by a caller that failed or was cancelled."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node_engine.weight_sync.staging import StagingSlots, deadline_after


class SlotTimeout(Exception):
    pass


def test_a_wait_past_the_deadline_fails_and_holds_nothing() -> None:
    async def main() -> None:
        slots = StagingSlots()
        async with slots.hold(deadline_after(5), SlotTimeout):
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(SlotTimeout, match="one at a time"):
                async with slots.hold(deadline_after(0.2), SlotTimeout):
                    raise AssertionError("two updates held the slot at once")
            assert 0.2 <= loop.time() - started < 4  # its own 0.2 s, not the holder's 5 s
            assert (slots.held, slots.waiting) == (1, 0)
        async with slots.hold(deadline_after(0.2), SlotTimeout):  # given back: the next one gets it at once
            assert slots.held == 1
        assert slots.held == 0

    asyncio.run(asyncio.wait_for(main(), 10))


def test_errors_and_cancellations_give_the_slot_back_and_let_go_of_the_tensors() -> None:
    async def main() -> None:
        slots = StagingSlots()
        kept: list[dict[str, torch.Tensor]] = []
        with pytest.raises(ValueError):
            async with slots.staged(deadline_after(5), SlotTimeout) as tensors:
                tensors["w"] = torch.zeros(2)
                kept.append(tensors)
                raise ValueError("a refused commit")
        assert kept[0] == {} and slots.held == 0

        inside = asyncio.Event()

        async def holder() -> None:
            async with slots.hold(deadline_after(5), SlotTimeout):
                inside.set()
                await asyncio.Event().wait()  # until cancelled (a client gone, a shutdown)

        async def waiter() -> None:
            async with slots.hold(deadline_after(5), SlotTimeout):
                raise AssertionError("a cancelled waiter got the slot")

        holding = asyncio.ensure_future(holder())
        await inside.wait()
        waiting = asyncio.ensure_future(waiter())
        while slots.waiting == 0:
            await asyncio.sleep(0)  # one turn of the loop: the waiter is queued behind the holder
        waiting.cancel()
        holding.cancel()
        for task in (waiting, holding):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert (slots.held, slots.waiting) == (0, 0)
        async with slots.hold(deadline_after(0.2), SlotTimeout):
            assert slots.held == 1

    asyncio.run(asyncio.wait_for(main(), 10))

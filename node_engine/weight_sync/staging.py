"""The engine's bound on weight updates holding new tensors at once: one at a time, as SGLang 0.5.23 runs them
(its tokenizer manager takes the model-update writer lock for a reload, a push and a broadcast update, and its
scheduler loads one after another).

What an update holds between its read and the end of its commit:

- a tensor push: the sender's shared-memory segments, each a mapping of the engine
  process (up to ``MAX_SEGMENTS``, 16,384, per payload; the kernel's
  ``vm.max_map_count`` is 65,530 by default, and past it every allocation of
  the process fails), or CUDA IPC handles opened;
- a reload: the whole checkpoint staged (on the device when it fits);
- a broadcast update: the received tensors.

Every update (a push's dry run too) takes :meth:`StagingSlots.hold` around the whole lifetime of its tensors,
from the read through the commit: ``async with`` gives the slot back on success, error and cancellation alike.
An update that finds the slot taken waits for it until its own deadline (``--weight-sync-timeout`` or
``--reload-timeout``, counted from the start of the call), then fails with the call's timeout error.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import torch

MAX_UPDATES_STAGED = 1  # x 16,384 segments of a push: a quarter of the default vm.max_map_count


class StagingSlots:
    """Updates holding staged tensors at once, at most ``size``; the others wait in order of arrival."""

    def __init__(self, size: int = MAX_UPDATES_STAGED) -> None:
        self.size = size
        self._free = asyncio.Semaphore(size)  # bound to the loop that first waits on it
        self.held = 0
        self.waiting = 0

    @asynccontextmanager
    async def hold(self, deadline: float, timed_out: Callable[[str], BaseException]) -> AsyncIterator[None]:
        """The slot for the body of the ``async with``. ``deadline`` is on the running loop's clock; past it,
        ``timed_out(why)`` is raised and nothing was held."""
        self.waiting += 1
        try:
            async with asyncio.timeout_at(deadline):
                await self._free.acquire()
        except TimeoutError:
            raise timed_out(f"{self.held} other weight update(s) still held the engine's staging slot "
                            f"(weight updates run one at a time)") from None
        finally:
            self.waiting -= 1
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            self._free.release()

    @asynccontextmanager
    async def staged(self, deadline: float,
                     timed_out: Callable[[str], BaseException]) -> AsyncIterator[dict[str, torch.Tensor]]:
        """The slot, and the dict an update keeps its tensors in: emptied as the slot is given back, so nothing
        the update read (a sender's segment, a staged checkpoint) outlives it, whatever its error holds on to."""
        async with self.hold(deadline, timed_out):
            tensors: dict[str, torch.Tensor] = {}
            try:
                yield tensors
            finally:
                tensors.clear()


def deadline_after(timeout_s: float) -> float:
    """The deadline ``timeout_s`` from now on the running loop's clock."""
    return asyncio.get_running_loop().time() + timeout_s


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (at least a millisecond, so a bounded wait still looks once)."""
    return max(deadline - asyncio.get_running_loop().time(), 0.001)

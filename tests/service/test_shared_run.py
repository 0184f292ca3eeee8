"""handoff/service/shared_run.py: concurrent callers share one run, a caller that leaves stops no one else."""

from __future__ import annotations

import asyncio

import pytest

from handoff.service.shared_run import SharedRun


class Work:
    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()

    async def __call__(self) -> int:
        self.runs += 1
        await self.release.wait()
        if self.runs == 2:
            raise ValueError("the second run fails")
        return self.runs


async def test_callers_while_it_runs_share_one_run_and_later_ones_start_another() -> None:
    work = Work()
    shared = SharedRun(work)
    callers = [asyncio.ensure_future(shared()) for _ in range(5)]
    await asyncio.sleep(0)  # let every caller reach the run
    leaver = callers.pop()
    leaver.cancel()  # its client left: the run goes on for the others
    work.release.set()
    assert await asyncio.wait_for(asyncio.gather(*callers), 5) == [1, 1, 1, 1]
    assert leaver.cancelled() and work.runs == 1
    with pytest.raises(ValueError, match="second run"):  # a run after the first ended is a new one, failure shared
        await asyncio.wait_for(asyncio.gather(shared(), shared()), 5)
    assert work.runs == 2

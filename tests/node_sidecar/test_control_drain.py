"""The drain's wait for the engine to run nothing (:mod:`node_sidecar.control_drain`) against an engine that is slow
to say: the drain's limit (cut to the caller's deadline header) bounds it, as it bounds the wait for the sidecar's
own requests and the abort."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from node_sidecar.control_drain import DrainLimit, Drainer
from node_sidecar.errors import DrainTimeout

pytestmark = pytest.mark.timeout(30)


class SlowEngine:
    """An engine that runs one request and takes ``delay`` seconds to say so, each time it is asked."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def requests_running(self) -> int:
        await asyncio.sleep(self.delay)
        return 1


class Idle:
    num_in_flight = 0

    async def drain(self, timeout: float, *, abort: object = None) -> bool:
        return True


def drainer(engine: SlowEngine) -> Drainer:
    metrics = SimpleNamespace(aborted_requests=None, drained_requests=None)
    return Drainer(SimpleNamespace(metrics=metrics, admission=Idle(), engine_adapter=engine))  # type: ignore[arg-type]


async def test_an_engine_slow_to_say_what_it_runs_does_not_stretch_the_drain() -> None:
    """Each poll of the engine's running requests waited for its answer (up to the engine client's 5 s) whatever
    the drain had left: a release with a 0.3 s drain (or a caller's deadline header) answered after the engine's
    answer, past the time the caller waits (found by review). Each poll is bounded by what is left now."""
    loop = asyncio.get_running_loop()
    for limit in (DrainLimit(0.3), DrainLimit(60.0, answer_by=loop.time() + 0.3)):
        started = loop.time()
        with pytest.raises(DrainTimeout) as error:
            await drainer(SlowEngine(3.0)).drain("wait", limit)
        assert loop.time() - started < 2.5, loop.time() - started  # 0.2-0.3 s; waiting the engine: 3 s
        assert error.value.status == 409

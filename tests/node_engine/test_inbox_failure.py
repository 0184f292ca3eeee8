"""An error on the engine thread while it handles what it took from its inbox (a bug in its own bookkeeping) closes
the engine, and everything it took in the same batch is answered all the same, as what was still queued is.

The engine thread takes every queued item at once, then handles them one by one: items taken after the one that
raised were dropped unanswered (found by review): a request never got its final output (its HTTP client waited
until the process went, its id held; not ``engine_stopped``, which tells the LB another node may serve it) and a
control call never returned.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from handoff.protocol import errors as E
from node_engine.config import EngineConfig
from node_engine.errors import EngineStopped
from node_engine.request import Request, RequestHandle, RequestOutput
from node_engine.sampling import SamplingParams
from tests.node_engine.engine_harness import running_engine

pytestmark = pytest.mark.timeout(60)

LONG = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


async def final(handle: RequestHandle) -> RequestOutput:
    while True:
        out = await asyncio.wait_for(handle.next(), timeout=15)
        if out.is_final:
            return out


async def test_what_the_engine_took_with_an_item_that_failed_it_is_answered(tmp_path: Path) -> None:
    drill = tmp_path / "fault.json"
    handed_over = threading.Event()
    config = EngineConfig(model_path="builtin:tiny", max_total_tokens=2048, fault_drill_file=drill)
    async with running_engine(config, on_fatal=lambda _: handed_over.set()) as engine:
        admit = engine.steps.admit

        def admit_or_fail(request: Request) -> None:  # fault injection: a bookkeeping bug hit by one request
            if request.rid == "boom":
                raise RuntimeError("a bug in the engine's bookkeeping")
            admit(request)

        engine.steps.admit = admit_or_fail  # type: ignore[method-assign]
        # A stall in a decode step holds the engine thread while the next items queue: it takes them in one batch.
        drill.write_text(json.dumps({"kind": "stall", "at": "decode", "delay_s": 2.0}))
        running = engine.submit([5, 6, 7], LONG)
        deadline = time.monotonic() + 20
        while not drill.with_name("fault.json.fired").exists():
            assert time.monotonic() < deadline, "the engine never stalled"
            await asyncio.sleep(0.005)
        boom = engine.submit([8, 9], SHORT, "boom")
        after = engine.submit([10, 11], SHORT, "after")
        call = asyncio.ensure_future(engine.call(lambda: "ran"))
        out = await final(running)
        assert out.error_type == E.ENGINE_FAILED.name
        for handle in (boom, after):  # neither ran: another node may serve them
            out = await final(handle)
            assert out.error_type == E.ENGINE_STOPPED.name, (handle.rid, out)
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(call, timeout=15)
        assert await asyncio.to_thread(handed_over.wait, 15)
        assert engine.num_calls_pending == 0
        assert not engine.gate.is_live("boom") and not engine.gate.is_live("after")

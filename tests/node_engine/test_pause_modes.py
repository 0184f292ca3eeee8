"""SGLang's pause modes in the engine: ``retract`` (back to the queue, KV freed, recomputed after continue) and
``in_place`` (KV kept, not stepping); weight updates and releases under a pause."""

from __future__ import annotations

import asyncio
import time

import pytest

from handoff.protocol.tags import ALL_TAGS
from node_engine.config import EngineConfig
from node_engine.engine import Engine, RequestHandle
from node_engine.errors import RequestsInFlight
from node_engine.sampling import SamplingParams
from tests.node_engine.engine_harness import generate, running_engine

PROMPT = [256, 72, 101, 108, 108, 111]
PARAMS = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)


async def _tokens_until(handle: RequestHandle, at_least: int, got: list[int]) -> None:
    while len(got) < at_least:
        out = await asyncio.wait_for(handle.next(), timeout=60)
        got.extend(out.token_ids_delta)
        assert not out.is_final


async def _rest(handle: RequestHandle, got: list[int]) -> list[int]:
    while True:
        out = await asyncio.wait_for(handle.next(), timeout=60)
        got.extend(out.token_ids_delta)
        if out.is_final:
            return got


def _take_queued(handle: RequestHandle, got: list[int]) -> None:
    while not handle._queue.empty():
        got.extend(handle._queue.get_nowait().token_ids_delta)


async def _paused_run(engine: Engine, mode: str, during) -> list[int]:
    """A greedy stream paused after a few tokens; ``during(engine)`` runs while paused."""
    handle = engine.submit(PROMPT, PARAMS, stream=True)
    got: list[int] = []
    await _tokens_until(handle, 4, got)
    answer = await engine.call(lambda: engine.control.pause(mode))
    assert answer["paused_requests"] == 1 and answer["retracted_requests"] == (1 if mode == "retract" else 0)
    _take_queued(handle, got)  # what the steps before the pause made (on a busy machine, several tokens)
    so_far = len(got)
    await during(engine)
    await asyncio.sleep(0.2)  # paused: no step runs, so nothing arrives (a wait for absence, bounded)
    _take_queued(handle, got)  # at most the step that was running when the pause came
    assert len(got) <= so_far + 1
    await engine.call(engine.control.continue_generation)
    return await _rest(handle, got)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_a_paused_request_finishes_after_continue_with_the_same_tokens(mode: str) -> None:
    config = EngineConfig(model_path="builtin:tiny", enable_memory_saver=True)
    async with running_engine(config) as engine:
        expected, _ = await generate(engine, PROMPT, PARAMS)

        async def nothing(_: Engine) -> None:
            # a new request while paused waits in the queue (SGLang queues it too)
            queued = engine.submit(PROMPT, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
            deadline = time.monotonic() + 10
            while engine.scheduler.num_requests < 2 and time.monotonic() < deadline:  # admitted on the engine thread
                await asyncio.sleep(0.005)
            assert queued._queue.empty() and engine.scheduler.num_requests == 2
            engine.abort(queued.rid)

        assert await _paused_run(engine, mode, nothing) == expected
        if mode == "retract":
            assert engine.scheduler.num_preemptions >= 1


async def test_release_under_a_retract_pause_and_refused_under_in_place() -> None:
    config = EngineConfig(model_path="builtin:tiny", enable_memory_saver=True)
    async with running_engine(config) as engine:
        expected, _ = await generate(engine, PROMPT, PARAMS)

        async def release_and_resume(e: Engine) -> None:
            tags = [t for t in ALL_TAGS if t.value != "weights"]
            await e.call(lambda: e.control.release(tags, None))  # retracted requests hold no KV
            await e.call(lambda: e.control.resume(None))

        assert await _paused_run(engine, "retract", release_and_resume) == expected

        async def refused(e: Engine) -> None:
            with pytest.raises(RequestsInFlight):
                await e.call(lambda: e.control.release(None, None))

        assert await _paused_run(engine, "in_place", refused) == expected


async def test_retracted_requests_queue_behind_the_requests_already_waiting() -> None:
    """SGLang's retract pause hands each running request to ``_add_request_to_queue``
    (``scheduler.py:5897-5905``), which appends it to the waiting queue (``:3493``), behind the requests that
    were waiting; its default policy, FCFS, keeps that order (``schedule_policy.py:231-265``)."""
    config = EngineConfig(model_path="builtin:tiny", max_running_requests=1)
    async with running_engine(config) as engine:
        expected, _ = await generate(engine, PROMPT, PARAMS)
        running = engine.submit(PROMPT, PARAMS, stream=True)
        got: list[int] = []
        await _tokens_until(running, 2, got)
        waiting = engine.submit(PROMPT, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        deadline = time.monotonic() + 10
        while engine.scheduler.num_requests < 2 and time.monotonic() < deadline:  # admitted on the engine thread
            await asyncio.sleep(0.005)
        assert engine.scheduler.num_requests == 2, "the second request was never admitted"
        await engine.call(lambda: engine.control.pause("retract"))
        order = await engine.call(lambda: [r.rid for r in engine.scheduler.waiting])
        assert order == [waiting.rid, running.rid]
        await engine.call(engine.control.continue_generation)
        assert len(await _rest(waiting, [])) == 2
        assert await _rest(running, got) == expected

"""A step that raises (issue 13): its requests fail and free their KV, everything queued is answered, and an
error that leaves the device unusable closes the engine after answering everything.

In-process engines (the fault drill makes the runner raise); tests/node_engine/test_engine_faults.py does
the same through real engine and sidecar processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from handoff.protocol import errors as E
from handoff.service.logs import RateLimit
from node_engine.config import EngineConfig
from node_engine.engine import Engine, RequestHandle
from node_engine.engine_steps import step_failure_log
from node_engine.errors import EngineStopped, StepFailed
from node_engine.failures import DeviceFailed, FaultDrill, leaves_device_unusable
from node_engine.request import FinishReason, RequestOutput
from node_engine.sampling import SamplingParams
from node_engine.server.generation_run import GenerationRun, SequenceSpec
from node_engine.step import Step, StepResult
from tests.node_engine.engine_harness import generate, running_engine

pytestmark = pytest.mark.timeout(60)

LONG = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
PROMPT_A = [256] + [(5 * i) % 256 for i in range(30)]
PROMPT_B = [(7 * i + 1) % 256 for i in range(41)]  # shares no first token with PROMPT_A


def arm(path: Path, kind: str, at: str, delay_s: float = 0.0) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kind": kind, "at": at, "delay_s": delay_s}))
    tmp.replace(path)


async def wait_fired(path: Path, timeout: float = 20) -> None:
    fired = path.with_name(path.name + ".fired")
    deadline = time.monotonic() + timeout
    while not fired.exists():
        assert time.monotonic() < deadline, "the fault drill did not fire"
        await asyncio.sleep(0.005)


async def final(handle: RequestHandle) -> tuple[list[RequestOutput], RequestOutput]:
    outputs = []
    while True:
        out = await asyncio.wait_for(handle.next(), timeout=30)
        outputs.append(out)
        if out.is_final:
            return outputs, out


def submit(engine: Engine, prompt: list[int], params: SamplingParams, *, stream: bool = False) -> RequestHandle:
    engine.gate.check(prompt, params)
    return engine.submit(prompt, params, stream=stream)


def assert_kv_settled(engine: Engine) -> None:
    """No request holds KV: every used slot belongs to the prefix cache, nothing is locked, every row is free."""
    scheduler = engine.scheduler
    assert not scheduler.running and not scheduler.waiting
    cache = scheduler.cache
    assert cache is not None
    assert scheduler.slots.num_used == cache.num_cached_tokens
    assert cache.num_evictable_tokens == cache.num_cached_tokens  # no prefix stays locked
    assert scheduler.rows.num_free == engine.config.max_running_requests


@pytest.fixture
def drill_file(tmp_path: Path) -> Path:
    return tmp_path / "fault.json"


def config(drill_file: Path) -> EngineConfig:
    return EngineConfig(model_path="builtin:tiny", max_total_tokens=2048, fault_drill_file=drill_file)


async def test_a_failed_prefill_fails_its_request_and_the_running_one_completes(drill_file: Path) -> None:
    async with running_engine(config(drill_file)) as engine:
        reference, _ = await generate(engine, PROMPT_B, SHORT)
        engine.scheduler.cache.flush()
        running = submit(engine, PROMPT_A, LONG, stream=True)
        await asyncio.wait_for(running.next(), timeout=30)  # prefilled: decoding from now on
        arm(drill_file, "oom", "prefill")
        failed = submit(engine, PROMPT_B, SHORT)
        _, out = await final(failed)
        assert out.error_type == E.ENGINE_FAILED.name and "OutOfMemoryError" in out.error
        assert out.finish_reason is None
        outputs, last = await final(running)
        assert last.error is None and last.finish_reason is not None
        assert sum(len(o.token_ids_delta) for o in outputs) + 1 == LONG.max_new_tokens
        assert_kv_settled(engine)
        prefix, _ = engine.scheduler.cache.match(PROMPT_B)
        assert prefix.numel() == 0  # the failed request's KV was never cached
        again, _ = await generate(engine, PROMPT_B, SHORT)
        assert again == reference


async def test_a_failed_decode_step_fails_every_request_in_it(drill_file: Path) -> None:
    async with running_engine(config(drill_file)) as engine:
        first = submit(engine, PROMPT_A, LONG, stream=True)
        second = submit(engine, PROMPT_B, LONG, stream=True)
        await asyncio.wait_for(first.next(), timeout=30)
        await asyncio.wait_for(second.next(), timeout=30)
        arm(drill_file, "error", "decode")
        for handle in (first, second):
            _, out = await final(handle)
            assert out.error_type == E.ENGINE_FAILED.name and "injected at decode" in out.error
        assert_kv_settled(engine)
        tokens, _ = await generate(engine, PROMPT_A, SHORT)
        assert len(tokens) == SHORT.max_new_tokens


async def test_a_call_queued_behind_a_failing_step_is_answered(drill_file: Path) -> None:
    async with running_engine(config(drill_file)) as engine:
        arm(drill_file, "oom", "decode", delay_s=0.5)
        handle = submit(engine, PROMPT_A, LONG)
        await wait_fired(drill_file)
        queued = submit(engine, PROMPT_B, SHORT)  # behind the failing step, in the inbox
        answer = await asyncio.wait_for(engine.call(engine.control.flush_cache), timeout=30)
        assert answer["success"] is True
        _, out = await final(handle)
        assert out.error_type == E.ENGINE_FAILED.name
        _, out = await final(queued)
        assert out.error is None and len(out.token_ids_delta) == SHORT.max_new_tokens
        assert engine.is_alive
        assert_kv_settled(engine)


async def test_a_fatal_step_answers_everything_then_hands_over(drill_file: Path) -> None:
    fatal: list[BaseException] = []
    handed_over = threading.Event()

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        handed_over.set()

    async with running_engine(config(drill_file), on_fatal=on_fatal) as engine:
        arm(drill_file, "fatal", "decode", delay_s=0.5)
        running = submit(engine, PROMPT_A, LONG)
        await wait_fired(drill_file)
        queued = submit(engine, PROMPT_B, SHORT)
        call = asyncio.ensure_future(engine.call(engine.control.flush_cache))
        _, out = await final(running)
        assert out.error_type == E.ENGINE_FAILED.name and "illegal memory access" in out.error
        _, out = await final(queued)
        assert out.error_type == E.ENGINE_STOPPED.name  # it never ran: another node may serve it
        with pytest.raises(EngineStopped, match="is exiting"):
            await asyncio.wait_for(call, timeout=30)
        assert await asyncio.to_thread(handed_over.wait, 30)
        assert isinstance(fatal[0], DeviceFailed) and isinstance(fatal[0].__cause__, torch.AcceleratorError)
        assert not engine.is_alive
        # After the close: answered at once, never queued.
        _, out = await final(submit(engine, PROMPT_B, SHORT))
        assert out.error_type == E.ENGINE_STOPPED.name
        with pytest.raises(EngineStopped):
            await engine.call(engine.control.flush_cache)


async def test_stopping_answers_what_is_queued(drill_file: Path) -> None:
    async with running_engine(config(drill_file)) as engine:
        arm(drill_file, "error", "decode", delay_s=0.5)
        running = submit(engine, PROMPT_A, LONG)
        await wait_fired(drill_file)
        queued = submit(engine, PROMPT_B, SHORT)
        engine.stop()
        for handle in (running, queued):
            _, out = await final(handle)
            assert out.error is not None


@pytest.mark.parametrize(("exc", "is_fatal"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (torch.AcceleratorError("CUDA error: out of memory"), False),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"), True),
    (RuntimeError("shape '[2, 3]' is invalid for input of size 5"), False),
    (IndexError("list index out of range"), False),
])
def test_which_step_errors_leave_the_device_unusable(exc: BaseException, is_fatal: bool) -> None:
    assert leaves_device_unusable(exc) is is_fatal


def test_the_drill_fires_once_and_only_where_it_is_armed(drill_file: Path) -> None:
    drill = FaultDrill(drill_file)
    drill.fire("decode")  # nothing armed
    arm(drill_file, "oom", "prefill")
    drill.fire("decode")
    drill.fire("release")
    with pytest.raises(torch.OutOfMemoryError, match="fault drill"):
        drill.fire("prefill")
    assert not drill_file.exists() and drill_file.with_name("fault.json.fired").exists()
    drill.fire("prefill")  # one shot
    arm(drill_file, "fatal", "step")
    with pytest.raises(torch.AcceleratorError):
        drill.fire("decode")


def test_the_drill_fires_once_when_threads_reach_it_together(drill_file: Path) -> None:
    """A parallel read's slices reach ``read`` at once: one of them fires the fault, the others go on (a race
    between them once raised ``FileNotFoundError`` from the losers' rename)."""
    import threading

    drill = FaultDrill(drill_file)
    arm(drill_file, "oom", "read")
    start = threading.Barrier(8, timeout=10)
    raised: list[BaseException] = []

    def reach() -> None:
        start.wait()
        for _ in range(50):
            try:
                drill.fire("read")
            except BaseException as exc:  # collected: the test counts what each thread saw
                raised.append(exc)

    threads = [threading.Thread(target=reach) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(raised) == 1 and isinstance(raised[0], torch.OutOfMemoryError), raised


async def test_a_failed_sample_aborts_its_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``n`` samples answered 500 for one failed sample: the others are aborted, not left running to their
    full length with nobody to answer (found by review: they held their KV and their ids, so a retry under
    the same ids was refused as a duplicate)."""
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    specs = [SequenceSpec(PROMPT_A, params, rid=f"sample-{i}", prompt_index=0) for i in range(2)]
    # One row: the second sample waits while the first decodes, so the failure reaches the first alone.
    async with running_engine(EngineConfig(model_path="builtin:tiny", max_running_requests=1,
                                           max_total_tokens=512)) as engine:
        run_step = engine.runner.run

        def failing_run(step: Step, eos_token_ids: tuple[int, ...]) -> StepResult:
            if any(e.request.rid == "sample-0" and e.request.output_ids for e in step.entries):
                raise ValueError("the drill: sample-0's first decode fails")
            return run_step(step, eos_token_ids)

        monkeypatch.setattr(engine.runner, "run", failing_run)
        run = GenerationRun(engine, specs)
        with pytest.raises(StepFailed):
            await run.collect()
        _, sibling = await final(run.handles[1])
        assert sibling.finish_reason is FinishReason.ABORT and sibling.num_output_tokens < params.max_new_tokens
        await engine.call(lambda: None)  # the engine thread took everything before
        assert_kv_settled(engine)
        assert not engine.gate.is_live("sample-1")


async def test_a_step_failing_again_and_again_logs_a_burst_not_a_traceback_each(
        drill_file: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    burst = RateLimit.DEFAULT_BURST
    fresh = [RateLimit() if isinstance(f, RateLimit) else f for f in step_failure_log.filters]
    monkeypatch.setattr(step_failure_log, "filters", fresh)  # a window no earlier test has used
    async with running_engine(config(drill_file)) as engine:
        with caplog.at_level(logging.ERROR, logger=step_failure_log.name):
            for _ in range(burst + 5):  # a client sending the batch that hits a bug again and again
                arm(drill_file, "error", "prefill")
                _, out = await final(submit(engine, PROMPT_B, SHORT))
                assert out.error_type == E.ENGINE_FAILED.name
        logged = [r for r in caplog.records if r.name == step_failure_log.name]
        assert len(logged) == burst and all(r.exc_info for r in logged)
        tokens, _ = await generate(engine, PROMPT_A, SHORT)
        assert len(tokens) == SHORT.max_new_tokens

"""Run a real Engine in-process (no HTTP) inside an async test."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.request import RequestOutput
from node_engine.sampling import SamplingParams


@contextlib.asynccontextmanager
async def running_engine(config: EngineConfig,
                         on_fatal: Callable[[BaseException], None] | None = None) -> AsyncIterator[Engine]:
    engine = Engine(config, on_fatal=on_fatal)
    engine.start(asyncio.get_running_loop())
    try:
        yield engine
    finally:
        engine.stop()


async def generate(engine: Engine, prompt_ids: list[int], params: SamplingParams, *,
                   logprobs: LogprobOptions | None = None) -> tuple[list[int], list[RequestOutput]]:
    engine.gate.check(prompt_ids, params, logprobs)
    handle = engine.submit(prompt_ids, params, logprobs=logprobs)
    outputs = []
    while True:
        out = await asyncio.wait_for(handle.next(), timeout=60)
        outputs.append(out)
        if out.is_final:
            break
    return [t for o in outputs for t in o.token_ids_delta], outputs

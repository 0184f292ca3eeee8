"""What one engine step adds to the token counters: the prompt tokens it prefilled, the tokens it generated."""

from __future__ import annotations

import asyncio

import pytest

from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.request import RequestHandle
from node_engine.sampling import SamplingParams
from tests.node_engine.engine_harness import running_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = [256, 72, 101, 108, 108, 111, 32, 119]


async def _final(handle: RequestHandle) -> None:
    while not (await asyncio.wait_for(handle.next(), timeout=30)).is_final:
        pass


def _count(engine: Engine, name: str) -> float:
    value = engine.metrics.registry.get_sample_value(f"handoff_engine_{name}_total")
    return 0.0 if value is None else value


async def test_a_prefill_only_request_generates_no_token() -> None:
    """The prefill of ``n`` samples' shared prompt and a scoring request (``max_new_tokens`` 0 with logprobs) sample
    a token to read its row and keep none: ``handoff_engine_generated_tokens_total`` counts only tokens kept."""
    async with running_engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=256)) as engine:
        await _final(engine.submit(PROMPT, SamplingParams(max_new_tokens=0), prefill=True))
        await _final(engine.submit(PROMPT, SamplingParams(max_new_tokens=0), logprobs=LogprobOptions(-1, 3)))
        assert _count(engine, "generated_tokens") == 0
        assert _count(engine, "prompt_tokens") == 2 * len(PROMPT) - (len(PROMPT) - 1)  # the second reused the first
        await _final(engine.submit(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
        assert _count(engine, "generated_tokens") == 3

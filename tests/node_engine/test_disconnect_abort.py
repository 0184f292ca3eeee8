"""A client that leaves aborts its own requests only (SGLang aborts a request whose HTTP client disconnected).

The abort of a run whose client left names its requests by id, and an id is given back the moment its final
output reaches the event loop, read or not. A client that left in the same loop turn as one of its requests
finished aborted that id, which another client could already have taken (found by review: a retry under the
same id was aborted by the disconnect of the client it replaced). In-process: the interleaving is one loop
turn wide; tests/node_engine/test_server.py and tests/e2e/test_disconnects.py leave through real HTTP.
"""

from __future__ import annotations

import pytest

from node_engine.config import EngineConfig
from node_engine.request import FinishReason
from node_engine.sampling import SamplingParams
from node_engine.server.generation_run import GenerationRun, SequenceSpec
from tests.node_engine.engine_harness import running_engine
from tests.node_engine.test_step_failures import PROMPT_A, PROMPT_B, assert_kv_settled, final
from tests.service.peers import until

pytestmark = pytest.mark.timeout(60)

SHORT = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_aborts_no_request_that_took_a_freed_id(stream: bool) -> None:
    async with running_engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=2048)) as engine:
        run = GenerationRun(engine, [SequenceSpec(PROMPT_A, SHORT, rid="reused"),
                                     SequenceSpec(PROMPT_B, LONG, rid="sibling", prompt_index=1)], stream=stream)
        # "reused" finished (its final output is on the loop, not read yet) and its id is free again ...
        await until(lambda: not engine.gate.is_live("reused"), timeout_s=30)
        engine.gate.check(PROMPT_B, LONG)
        theirs = engine.submit(PROMPT_B, LONG, "reused")  # ... for another client's request
        run.abort_unfinished()  # the first client leaves
        _, sibling = await final(run.handles[1])
        assert sibling.finish_reason is FinishReason.ABORT  # its own unfinished request is aborted
        _, answer = await final(theirs)
        assert answer.finish_reason is FinishReason.LENGTH and answer.num_output_tokens == LONG.max_new_tokens
        await engine.call(lambda: None)  # the engine thread took everything before
        assert_kv_settled(engine)

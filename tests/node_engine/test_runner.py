"""Decode-path shortcuts of the runner give the same tokens as the general path.

Drives the scheduler and the runner directly (no engine thread), so which
requests share a step is deterministic.
"""

from __future__ import annotations

import pytest

from node_engine.config import EngineConfig
from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.engine import Engine
from node_engine.request import Request
from node_engine.sampling import SamplingParams
from node_engine.step import StepKind

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024))


def run_together(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
    """Greedy outputs of ``prompts`` admitted in one step; and, per decode step, whether it was ragged."""
    scheduler, runner = engine.scheduler, engine.runner
    requests = [Request(rid=f"r{n}", prompt_ids=p, params=GREEDY, on_output=lambda _: None,
                        detokenizer=IncrementalDetokenizer(engine.tokenizer)) for n, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    is_ragged = []
    while scheduler.has_work:
        step = scheduler.schedule()
        assert step is not None
        if step.kind is StepKind.DECODE:
            is_ragged.append(len({e.start for e in step.entries}) > 1)
        scheduler.postprocess(step, runner.run(step))
    return [r.output_ids for r in requests], is_ragged


@pytest.mark.parametrize("lengths", [[9, 9, 9, 9], [3, 9, 17, 30]], ids=["same-length", "ragged"])
def test_batched_decode_matches_each_request_alone(engine: Engine, lengths: list[int]) -> None:
    """Same-length batches decode without an attention mask, ragged ones with it; both match solo runs."""
    prompts = [[256] + [(7 * n + 3 * i) % 256 for i in range(length - 1)] for n, length in enumerate(lengths)]
    alone = [run_together(engine, [p])[0][0] for p in prompts]
    together, is_ragged = run_together(engine, prompts)
    assert together == alone
    assert all(len(tokens) == 24 for tokens in alone)
    assert set(is_ragged) == {len(set(lengths)) > 1}


def test_a_prefill_batch_of_uneven_chunks_matches_each_request_alone(engine: Engine) -> None:
    """Chunks of similar length are padded into one attention call (the same-length test above); a long one
    among short ones is not (its padding would cost num_seqs x longest queries): each sequence attends on its
    own, and the tokens match solo runs."""
    from node_engine.prefill_batch import RAGGED_FACTOR

    lengths = [300, 3, 5, 2, 4]
    assert len(lengths) * max(lengths) > RAGGED_FACTOR * sum(lengths)
    prompts = [[256] + [(5 * n + 11 * i) % 256 for i in range(length - 1)] for n, length in enumerate(lengths)]
    alone = [run_together(engine, [p])[0][0] for p in prompts]
    assert run_together(engine, prompts)[0] == alone
    # A second chunk (after a first one of 400 tokens) in a per-sequence batch: its mask starts at its offset.
    chunked = Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, max_batch_tokens=400))
    scheduler = chunked.scheduler
    long_prompt = [256] + [(13 * i) % 256 for i in range(599)]
    requests = [Request(rid=f"c{n}", prompt_ids=p, params=GREEDY, on_output=lambda _: None,
                        detokenizer=IncrementalDetokenizer(engine.tokenizer))
                for n, p in enumerate([long_prompt] + prompts[1:])]
    for request in requests:
        scheduler.add(request)
    starts = []
    while scheduler.has_work:
        step = scheduler.schedule()
        if step.kind is StepKind.PREFILL:
            starts.append([e.start for e in step.entries])
        scheduler.postprocess(step, chunked.runner.run(step))
    assert starts[:2] == [[0], [400] + [0] * (len(prompts) - 1)]
    assert [r.output_ids for r in requests[1:]] == alone[1:]
    assert requests[0].output_ids == run_together(engine, [long_prompt])[0][0]

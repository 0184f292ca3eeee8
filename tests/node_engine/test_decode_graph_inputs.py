"""What a CUDA decode graph computes, run eagerly on CPU (issue 18, item 6).

Capturing needs a GPU (tests/gpu); the graph's inputs and forward do not: :class:`DecodeGraphInputs` fills the
fixed buffers from a decode step and runs the forward a graph would replay, padded to a batch size and to a
key-count bucket. It must give what the runner's eager decode gives, attend over the bucket of the longest
sequence only (not the whole context), and ignore whatever the buffers hold past that bucket.
"""

from __future__ import annotations

import pytest
import torch

from node_engine.config import EngineConfig
from node_engine.cuda_graph import DecodeGraphInputs, context_buckets, graph_batch_sizes, padded
from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.engine import Engine
from node_engine.request import Request
from node_engine.sampling import SamplingParams
from node_engine.step import StepKind

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
CONTEXT = 128


def test_buckets_double_up_to_the_context() -> None:
    assert context_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert context_buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert context_buckets(100) == [100]
    assert context_buckets(128, smallest=16) == [16, 32, 64, 128]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32] and graph_batch_sizes(5) == [1, 2, 4, 5]
    assert [padded([16, 32, 64], n) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, context_length=CONTEXT))


@pytest.mark.parametrize("lengths", [[5], [3, 9, 20], [2, 20, 21, 30, 6], [2, 70, 9]], ids=["one", "three", "five", "long"])
def test_graph_inputs_decode_like_the_eager_path(engine: Engine, lengths: list[int]) -> None:
    scheduler, runner = engine.scheduler, engine.runner
    batch_sizes = graph_batch_sizes(8)
    inputs = DecodeGraphInputs(runner, batch_sizes[-1], context_buckets(CONTEXT, smallest=16))
    inputs.kv_indices.fill_(runner.kv_plan.num_slots - 1)  # stale rows: must never be attended to
    prompts = [[256] + [(5 * n + 3 * i) % 256 for i in range(length - 1)] for n, length in enumerate(lengths)]
    requests = [Request(rid=f"r{n}", prompt_ids=p, params=GREEDY, on_output=lambda _: None,
                        detokenizer=IncrementalDetokenizer(engine.tokenizer)) for n, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    shapes = set()
    with torch.inference_mode():
        while scheduler.has_work:
            step = scheduler.schedule()
            assert step is not None
            if step.kind is StepKind.DECODE:
                eager = runner._forward_decode(step)
                bs, num_keys = inputs.fill(step, batch_sizes)
                longest = max(e.start for e in step.entries) + 1
                assert bs == padded(batch_sizes, len(step.entries)) and longest <= num_keys < max(2 * longest, 17)
                shapes.add((bs, num_keys))
                graph = inputs.forward(bs, num_keys)[:len(step.entries)]
                torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
            scheduler.postprocess(step, runner.run(step))
    if max(lengths) + GREEDY.max_new_tokens <= CONTEXT // 2:  # short sequences never attend over the whole table
        assert all(num_keys < CONTEXT for _, num_keys in shapes)
    assert all(len(r.output_ids) == GREEDY.max_new_tokens for r in requests)

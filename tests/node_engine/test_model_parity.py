"""Logits and greedy continuations match transformers on tiny random checkpoints (float32, CPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from node_engine.config import EngineConfig
from node_engine.memory.saver import DisabledSaver
from node_engine.model.source import load_model_source
from node_engine.runner import ModelRunner
from node_engine.sampling import SamplingParams
from tests.node_engine.checkpoints import KINDS, make_checkpoint
from tests.node_engine.engine_harness import generate, running_engine

PROMPT = [256] + list(range(40, 140, 3))


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(folder, request.param)
    return folder, model


def test_logits_match_transformers(checkpoint) -> None:
    folder, reference = checkpoint
    assert len(list(Path(folder).glob("*.safetensors"))) > 1, "the checkpoint should be sharded"
    config = EngineConfig(model_path=str(folder))
    arch, _ = load_model_source(config)
    runner = ModelRunner(config, DisabledSaver(), arch)
    ours = runner.score(PROMPT)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


def test_llama3_rope_scaling_is_applied(tmp_path: Path) -> None:
    """Guards the parity test: dropping the scaling must change the logits."""
    reference = make_checkpoint(tmp_path, "llama-gqa-untied-llama3")
    config = EngineConfig(model_path=str(tmp_path))
    arch, _ = load_model_source(config)
    long_prompt = [(7 * i) % 256 for i in range(500)]  # low frequencies only matter at long range
    scaled = ModelRunner(config, DisabledSaver(), arch).score(long_prompt)
    unscaled = ModelRunner(config, DisabledSaver(), replace(arch, rope_scaling=None)).score(long_prompt)
    with torch.no_grad():
        theirs = reference(torch.tensor([long_prompt])).logits[0].float()
    assert (scaled - theirs).abs().max().item() < 1e-4
    # Random weights make attention nearly uniform, so positions move the logits only a little;
    # what matters is that a missing scaling breaks the 1e-4 parity bound the test above holds to.
    assert (unscaled - theirs).abs().max().item() > 2e-4


@pytest.mark.parametrize("max_batch_tokens", [4096, 7])
async def test_greedy_continuation_matches_generate(checkpoint, max_batch_tokens: int) -> None:
    """32 greedy tokens through the scheduler and decode path, with and without chunked prefill."""
    folder, reference = checkpoint
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, min_new_tokens=32)[0, len(PROMPT):].tolist()
    config = EngineConfig(model_path=str(folder), max_batch_tokens=max_batch_tokens, max_total_tokens=512)
    async with running_engine(config) as engine:
        tokens, outputs = await generate(engine, PROMPT, SamplingParams(max_new_tokens=32, temperature=0,
                                                                        ignore_eos=True))
    assert tokens == expected
    assert outputs[-1].finish_reason is not None and outputs[-1].finish_reason.value == "length"


@pytest.fixture
def onednn_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send every CPU float32 projection through oneDNN (normally only large products go there)."""
    from node_engine.model import projection as projections

    if projections._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(projections, "ONEDNN_MIN_WEIGHT_NUMEL", 1)


async def test_onednn_projections_match_transformers(checkpoint, onednn_everywhere) -> None:
    folder, reference = checkpoint
    config = EngineConfig(model_path=str(folder), max_total_tokens=512)
    arch, _ = load_model_source(config)
    runner = ModelRunner(config, DisabledSaver(), arch)
    assert runner.model.model.layers[0].self_attn.qkv.is_onednn
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, min_new_tokens=32)[0, len(PROMPT):].tolist()
    assert (runner.score(PROMPT) - theirs).abs().max().item() < 1e-4
    async with running_engine(config) as engine:
        tokens, _ = await generate(engine, PROMPT, SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))
    assert tokens == expected

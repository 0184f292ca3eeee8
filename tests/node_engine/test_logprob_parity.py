"""Logprobs equal transformers' log_softmax on the same checkpoint (float32, CPU), as SGLang defines them."""

from __future__ import annotations

import pytest
import torch

from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.config import EngineConfig
from node_engine.sampling import SamplingParams
from tests.node_engine.checkpoints import make_checkpoint
from tests.node_engine.engine_harness import generate, running_engine

PROMPT = [256] + list(range(40, 100, 3))
TOP = 5
IDS = (7, 65, 257)
BOUND = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("parity")
    return folder, make_checkpoint(folder, "llama-gqa-untied-llama3")


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def penalized(logits: torch.Tensor, output: list[int], p: SamplingParams) -> torch.Tensor:
    """SGLang's penalties, written out the slow way: frequency and presence, then repetition."""
    row = logits.clone()
    for token in set(output):
        count = output.count(token)
        row[token] -= p.frequency_penalty * count + p.presence_penalty
        row[token] = row[token] * p.repetition_penalty if row[token] < 0 else row[token] / p.repetition_penalty
    return row


async def run(folder, params: SamplingParams, options: LogprobOptions, **config) -> tuple[list[int], list]:
    async with running_engine(EngineConfig(model_path=str(folder), max_total_tokens=512, **config)) as engine:
        tokens, outputs = await generate(engine, PROMPT, params, logprobs=options)
    return tokens, outputs


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.8, ignore_eos=True, seed=1),
    SamplingParams(max_new_tokens=12, temperature=0.6, top_k=20, ignore_eos=True, seed=2),
    SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True, seed=3, repetition_penalty=1.4,
                   frequency_penalty=0.5, presence_penalty=0.3),
], ids=["greedy", "sampled-top-p", "temperature-top-k", "penalties"])
async def test_output_logprobs_match_transformers(checkpoint, params: SamplingParams) -> None:
    folder, model = checkpoint
    options = LogprobOptions(start_len=-1, top_logprobs_num=TOP, token_ids=IDS)
    tokens, outputs = await run(folder, params, options)
    ours = [lp for out in outputs for lp in out.output_logprobs]
    assert len(ours) == len(tokens) == 12
    logits = reference_logits(model, PROMPT + tokens)
    temperature = 1.0 if params.is_greedy else params.temperature
    for i, (token, lp) in enumerate(zip(tokens, ours, strict=True)):
        expected = torch.log_softmax(penalized(logits[len(PROMPT) - 1 + i], tokens[:i], params) / temperature, -1)
        assert abs(lp.logprob - expected[token].item()) < BOUND
        values, ids = expected.topk(TOP)
        assert lp.top[1] == ids.tolist() and max(abs(a - b) for a, b in zip(lp.top[0], values.tolist())) < BOUND
        assert max(abs(a - expected[t].item()) for a, t in zip(lp.token_ids, IDS)) < BOUND


@pytest.mark.parametrize("start_len,max_batch_tokens", [(0, 4096), (5, 7)], ids=["whole", "chunked-from-5"])
async def test_prompt_logprobs_match_transformers(checkpoint, start_len: int, max_batch_tokens: int) -> None:
    folder, model = checkpoint
    options = LogprobOptions(start_len=start_len, top_logprobs_num=TOP, token_ids=IDS)
    _, outputs = await run(folder, SamplingParams(max_new_tokens=2, temperature=0.7, seed=4), options,
                           max_batch_tokens=max_batch_tokens)
    [computed] = [out.input_logprobs for out in outputs if out.input_logprobs is not None]
    assert computed.token_ids == PROMPT[start_len:] and computed.values[0] is None
    expected = torch.log_softmax(reference_logits(model, PROMPT), -1)  # raw: no temperature on the prompt
    for position, value, top, picked in zip(range(start_len + 1, len(PROMPT)), computed.values[1:],
                                            computed.top[1:], computed.token_ids_logprobs[1:], strict=True):
        row = expected[position - 1]
        assert abs(value - row[PROMPT[position]].item()) < BOUND
        assert top[1] == row.topk(TOP).indices.tolist()
        assert max(abs(a - row[t].item()) for a, t in zip(picked, IDS)) < BOUND


async def test_original_logprob_flag_drops_the_temperature(checkpoint) -> None:
    folder, model = checkpoint
    params = SamplingParams(max_new_tokens=4, temperature=0.5, ignore_eos=True, seed=5)
    tokens, outputs = await run(folder, params, LogprobOptions(start_len=-1), return_original_logprob=True)
    logits = reference_logits(model, PROMPT + tokens)
    for i, lp in enumerate(lp for out in outputs for lp in out.output_logprobs):
        raw = torch.log_softmax(logits[len(PROMPT) - 1 + i], -1)[tokens[i]].item()
        assert abs(lp.logprob - raw) < BOUND

from __future__ import annotations

import pytest
import torch

from node_engine.logits import apply_penalties
from node_engine.sampling import SamplingParams, sample


@pytest.mark.parametrize("kwargs,field", [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop"), ({"seed": 2**64}, "seed"), ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens"),
])
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_greedy_and_seeded_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = [SamplingParams(temperature=0)] * 3
    assert sample(logits, greedy, [None] * 3) == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=7)

    def draw() -> list[int]:
        gens = [torch.Generator().manual_seed(7) for _ in range(3)]
        return [sample(logits, [p] * 3, gens) for _ in range(5)][-1]
    assert draw() == draw()


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    gen = torch.Generator().manual_seed(0)
    top_k = [sample(logits, [SamplingParams(temperature=5.0, top_k=2)], [gen])[0] for _ in range(200)]
    assert set(top_k) <= {0, 1} and set(top_k) == {0, 1}
    # probabilities ~ [0.665, 0.245, 0.09]; top_p=0.8 keeps the first two only
    top_p = [sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [gen])[0] for _ in range(300)]
    assert set(top_p) == {0, 1}


def test_values_float32_cannot_hold_are_refused() -> None:
    """A repetition penalty that is 0 in float32 (x / 0) and a bias past float32's range (inf) passed the float64
    checks, and the NaN they made failed every request of the step (multinomial raised)."""
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 1e300),))
    SamplingParams(repetition_penalty=float(torch.finfo(torch.float32).tiny),
                   logit_bias=((3, 3e38), (4, float("-inf"))))


def test_extreme_but_valid_values_sample_without_nan() -> None:
    """The largest bias over a tiny temperature, a tiny penalty over a large logit: overflow to inf would make
    softmax NaN; each row still samples, and the logprobs stay finite."""
    logits = torch.randn(3, 16) * 50
    biased = SamplingParams(temperature=1e-3, logit_bias=((5, 3e38),), seed=1)
    penalized = SamplingParams(temperature=0.5, repetition_penalty=float(torch.finfo(torch.float32).tiny), seed=2)
    plain = SamplingParams(temperature=1.0, seed=3)
    apply_penalties(logits, [(biased, []), (penalized, [0, 1, 2]), (plain, [])], eos_token_ids=[0])
    assert not logits.isnan().any() and not logits.isposinf().any()
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens = sample(logits, [biased, penalized, plain], generators)
    assert tokens[0] == 5 and all(0 <= t < 16 for t in tokens)
    assert torch.log_softmax(logits, dim=-1).isfinite().all()


def test_top_k_and_top_p_together_cut_on_the_whole_distribution_as_sglang() -> None:
    """SGLang (its PyTorch backend, and FlashInfer's ``joint`` order it uses without min_p) cuts top-p on the
    cumulative probability of the whole distribution, then samples what top-k and top-p both keep. Here top-p ran on
    the distribution renormalised after top-k: probabilities [0.4, 0.25, 0.2, 0.15] with top_k 2 and top_p 0.5 kept
    token 0 alone (0.4 / 0.65 > 0.5), where SGLang samples token 1 with 0.25 / 0.65 (0.4 is not past 0.5)."""
    logits = torch.tensor([[0.4, 0.25, 0.2, 0.15]]).log()
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    draws = [sample(logits, [p], [gen])[0] for _ in range(600)]
    assert set(draws) == {0, 1}
    assert 170 <= draws.count(1) <= 290  # 600 x 0.385 is 231
    # min_p stays relative to the most likely token of what top-k and top-p keep
    draws = [sample(logits, [SamplingParams(temperature=1.0, top_k=2, top_p=0.5, min_p=0.7)], [gen])[0]
             for _ in range(100)]
    assert set(draws) == {0}

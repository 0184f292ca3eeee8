from __future__ import annotations

import pytest
import torch

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

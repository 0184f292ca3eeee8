"""/weights_checker's compare, reset and checksum work a chunk at a time, as SGLang 0.5.23's do
(``utils/weight_checker_comparator.py``: ``CHUNK_NUMEL`` elements, compared in float32 on the weight's device):
no float32 copy of a whole tensor (an 8B model's 0.5 G-element embedding would be 2 GiB), and the same answer as a
whole-tensor comparison.

The checker runs on a stand-in engine (a model, no packed projections): what is measured is the checker's own
allocations, each op's fresh output storage seen through a ``TorchDispatchMode``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from handoff.protocol.weights import WeightsCheckerBody
from node_engine import weights_checker
from node_engine.weights_checker import WeightsChecker

CHUNK = 512


class LargestAllocation(TorchDispatchMode):
    """The largest storage any op allocated (an output that shares no input's storage), in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 50, dtype=torch.bfloat16)    # 5000 elements: ten chunks
    model.proj = torch.nn.Linear(50, 30, dtype=torch.float16)
    model.register_buffer("steps", torch.arange(3000, dtype=torch.int32))
    model.register_buffer("mask", torch.rand(2000) > 0.5)
    return model


def _checker(model: torch.nn.Module) -> WeightsChecker:
    packing = SimpleNamespace(projections=[], unpack=lambda: None, try_pack=lambda: False, is_held_plain=True)
    control = SimpleNamespace(require_idle=lambda *args, **kwargs: None, flush=lambda: None)
    memory = SimpleNamespace(released_tags=lambda: set(), mark_weights_invalid=lambda: None)
    engine = SimpleNamespace(runner=SimpleNamespace(model=model, packing=packing), control=control, memory=memory)
    return WeightsChecker(engine)  # type: ignore[arg-type]


def _run(checker: WeightsChecker, action: str) -> tuple[int, dict]:
    return checker.handle(WeightsCheckerBody.model_validate({"action": action}))


def _measured(call: Callable[[], Any]) -> tuple[Any, int]:
    with torch.no_grad(), LargestAllocation() as mode:
        result = call()
    return result, mode.largest


def test_reset_compare_and_checksum_allocate_a_chunk_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_checker, "CHUNK_NUMEL", CHUNK, raising=False)
    monkeypatch.setattr(weights_checker, "HASH_CHUNK_BYTES", CHUNK * 4)
    model = _model()
    checker = _checker(model)
    assert _run(checker, "snapshot")[0] == 200
    bound = CHUNK * 4  # one float32 chunk; a whole-tensor float32 copy of the embedding is 20000 bytes
    (status, _), largest = _measured(lambda: _run(checker, "reset_tensors"))
    assert status == 200 and largest <= bound, largest
    (status, answer), largest = _measured(lambda: _run(checker, "compare"))
    assert status == 400 and "name=embed.weight" in answer["message"]
    assert largest <= bound, largest
    (status, _), largest = _measured(lambda: _run(checker, "checksum"))
    assert status == 200 and largest <= bound, largest


def test_a_chunked_comparison_answers_as_a_whole_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same message, number for number, with chunks of 512 elements and with one chunk per tensor (the
    differences are multiples of 1/8, so every sum is exact), and the numbers SGLang's formulas give."""
    model = _model()
    checker = _checker(model)
    with torch.no_grad():
        model.embed.weight.copy_(torch.zeros(100, 50))
    assert _run(checker, "snapshot")[0] == 200
    with torch.no_grad():
        model.embed.weight.copy_(torch.arange(5000).reshape(100, 50) % 64 / 8)
        model.proj.weight.view(-1)[1234] = float("nan")
        model.steps[2500:] += 3
        model.mask[1999] = ~model.mask[1999]
    expected = {}
    for chunk in (CHUNK, 10**9):
        monkeypatch.setattr(weights_checker, "CHUNK_NUMEL", chunk, raising=False)
        status, answer = _run(checker, "compare")
        assert status == 400
        expected[chunk] = answer["message"]
    assert expected[CHUNK] == expected[10**9]
    lines = {line.split()[0]: line for line in expected[CHUNK].splitlines()[1:]}
    assert sorted(lines) == ["name=embed.weight", "name=mask", "name=proj.weight", "name=steps"]
    assert "max_abs_err=3.0 mean_abs_err=0.5 num_exceed=500 " in lines["name=steps"]
    assert "max_abs_err=1.0 mean_abs_err=0.0005 num_exceed=1 " in lines["name=mask"]
    # 0, 1/8, ..., 63/8 over and over (5000 = 78 x 64 + 8): 4921 non-zero, summing to 78 x 252 + 3.5
    assert "max_abs_err=7.875 mean_abs_err=3.9319 num_exceed=4921 " in lines["name=embed.weight"]
    assert "max_abs_err=nan mean_abs_err=nan num_exceed=1 " in lines["name=proj.weight"]
    assert "name=proj.bias" not in expected[CHUNK]

"""Projections: ``x @ weight.T + bias`` over parameters a module owns, through oneDNN for large CPU float32
weights (one opaque ``handoff::onednn_project`` op under ``torch.compile``), else ``F.linear``.

Parameters are created with ``torch.empty`` (no random init): the loader fills them, and the engine allocates them
inside the ``weights`` memory region; ``layers.py`` says why the hot path keeps direct references to them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# On CPU in float32, oneDNN's GEMM beats MKL's sgemm on large weight matrices (1.4-2x for the
# ~100M model of docs/benchmarks.md, at every batch size) and loses on small ones (up to 1.8x
# slower on builtin:tiny's), where a call's fixed cost dominates.
ONEDNN_MIN_WEIGHT_NUMEL = 1 << 19


def _find_onednn_linear() -> Callable[..., torch.Tensor] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


_ONEDNN_LINEAR = _find_onednn_linear()

# oneDNN projections by id, for ``handoff::onednn_project`` (weak: a dropped model frees its weights).
_ONEDNN_PROJECTIONS: weakref.WeakValueDictionary[int, Projection] = weakref.WeakValueDictionary()
_projection_ids = itertools.count()


@torch.library.custom_op("handoff::onednn_project", mutates_args=())
def onednn_project(x: torch.Tensor, projection_id: int) -> torch.Tensor:
    """A oneDNN projection as one opaque op, for ``torch.compile``.

    Inductor lowers oneDNN's linear only for weights frozen into the graph as
    constants, and a packed weight is an opaque tensor it cannot trace; the
    weights here change in place (reloads, the memory saver). The compiled
    graph passes the projection's id instead, and this op runs the eager call.
    """
    return _ONEDNN_PROJECTIONS[projection_id].onednn(x)


@onednn_project.register_fake
def _(x: torch.Tensor, projection_id: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _ONEDNN_PROJECTIONS[projection_id].weight.shape[0]))


def _param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Projection:
    """``x @ weight.T + bias`` for 2-D ``x``, over parameters owned by a module.

    Large CPU float32 weights (at least ``ONEDNN_MIN_WEIGHT_NUMEL`` elements) go
    through oneDNN when torch has it, everything else through ``F.linear``.
    While ``packed`` is set (``packing.WeightPacking`` owns it) the product uses
    that copy of the weight in oneDNN's layout and ``weight`` holds no memory.
    Under ``torch.compile`` a oneDNN product is one ``handoff::onednn_project``.
    """

    __slots__ = ("weight", "bias", "is_onednn", "packed", "projection_id", "__weakref__")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.is_onednn = (_ONEDNN_LINEAR is not None and weight.device.type == "cpu"
                          and weight.dtype == torch.float32 and weight.numel() >= ONEDNN_MIN_WEIGHT_NUMEL)
        self.projection_id = next(_projection_ids)
        if self.is_onednn:
            _ONEDNN_PROJECTIONS[self.projection_id] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_onednn:
            if torch.compiler.is_compiling():
                return torch.ops.handoff.onednn_project(x, self.projection_id)
            return self.onednn(x)
        return F.linear(x, self.weight, self.bias)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The oneDNN product, eager: on the packed weight while there is one, else on the plain one."""
        weight = self.weight if self.packed is None else self.packed
        return _ONEDNN_LINEAR(x, weight, self.bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, device=device, dtype=dtype)
        self.bias = _param(out_features, device=device, dtype=dtype) if bias else None
        self.project = Projection(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)

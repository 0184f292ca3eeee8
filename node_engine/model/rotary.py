"""Rotary position embeddings: the inverse frequencies (llama3 scaling too), the cos/sin table of every position,
and the rotation applied in place."""

from __future__ import annotations

import math

import torch

from node_engine.model.arch import Llama3RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to the context length.

    A small buffer built once and kept outside every memory region: it must
    survive a release of the weights. ``sin`` carries the sign of
    ``rotate_half`` (its first half is negated), so applying the rotation needs
    a ``roll`` of the input instead of a negate-and-concatenate; the products
    are bitwise those of transformers' ``q * cos + rotate_half(q) * sin``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Llama3RopeScaling | None,
                 *, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.head_dim = head_dim
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin()
        sin[:, :head_dim // 2].neg_()
        self.sin = sin.to(device=device, dtype=dtype)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    @property
    def nbytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] of ``positions``, broadcastable over heads."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` [T, H, D] in place by the [T, 1, D] tables of :meth:`RotaryTable.lookup`."""
    x.copy_(x * cos + x.roll(x.shape[-1] // 2, -1) * sin)  # not ``out=x``: torch.compile refuses a strided out

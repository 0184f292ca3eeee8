"""Building blocks of the Llama/Qwen2 forward pass.

Parameters are created with ``torch.empty`` on the target device and dtype (no
random init): the loader fills them, and the engine allocates them inside the
``weights`` memory region. A parameter never changes identity afterwards
(reloads copy into it, the memory saver frees and re-allocates its storage in
place), so the hot path keeps direct references to them (``Projection``, the
norm weights a ``DecoderLayer`` holds) instead of going through ``nn.Module``
attribute lookups on every call: for a small model those cost as much as the
arithmetic.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from node_engine.model.arch import Llama3RopeScaling

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm, for bitwise-close logits.
    if x.dtype is torch.float32:  # torch's own op: the same arithmetic (bitwise), one dispatch
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


@dataclass
class AttentionBatch:
    """How the tokens of one forward step map onto sequences and KV slots.

    Built once per step by the runner and shared by every layer. Tokens are
    flat (``T`` of them, sequences back to back). ``kv_indices`` lists, per
    sequence, the slots of its whole context (cached prefix and the new tokens),
    padded to the longest; ``mask`` hides the padding and, for prefill, the
    future (``None`` when there is neither: every sequence has the same length
    and one query). When every sequence contributes one token (decode) the
    queries need no padding; otherwise ``q_pad_index``/``q_unpad_index`` move
    them between the flat and the padded layout.
    """

    slot_mapping: torch.Tensor        # [T] slot of each new token
    kv_indices: torch.Tensor          # [B, L] slots of each sequence's context
    mask: torch.Tensor | None         # [B, 1, N, L] bool, True = attend
    num_seqs: int
    max_query_len: int                # N
    q_pad_index: torch.Tensor | None = None    # [B*N] flat token index of each padded query
    q_unpad_index: torch.Tensor | None = None  # [T] padded index of each flat token
    is_causal_self_only: bool = False          # one sequence, no cached prefix: plain causal attention
    # Chunks too different in length to pad (a long one among short ones): attention runs per sequence, with
    # (first flat token, queries, keys, [queries, keys] mask or None for plain causal) each; ``mask`` is None.
    sequences: list[tuple[int, int, int, torch.Tensor | None]] | None = None
    kv_flat: torch.Tensor = field(init=False)  # [B*L] ``kv_indices`` flattened once for every layer's gather

    def __post_init__(self) -> None:
        self.kv_flat = self.kv_indices.reshape(-1)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias, device=device, dtype=dtype)
        self.o_proj = Linear(self.q_size, hidden_size, bias=False, device=device, dtype=dtype)
        self.qkv = self.qkv_proj.project
        self.o = self.o_proj.project
        self.scale = head_dim ** -0.5
        # [num_slots, 2 * Hkv, D] view of the KV pool (keys, then values, of each slot); bound by the runner.
        self.kv_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_heads = self.num_heads
        qkv = self.qkv(x).view(num_tokens, num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k are adjacent in the fused projection: one rotation covers both. It is written back in
        # place so that k and v stay adjacent too, and one copy stores both into the pool.
        qk = qkv[:, :num_heads + self.num_kv_heads]
        rotate_into(qk, cos, sin)
        self.kv_cache.index_copy_(0, batch.slot_mapping, qkv[:, num_heads:])
        return self.o(self._attend(qkv, batch))

    def _attend(self, qkv: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        q = qkv[:, :num_heads]
        if batch.is_causal_self_only:
            k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return out.squeeze(0).transpose(0, 1).reshape(num_tokens, self.q_size)
        if batch.sequences is not None:
            return self._attend_each(q, batch)
        num_seqs, max_len = batch.kv_indices.shape
        kv = self.kv_cache.index_select(0, batch.kv_flat).view(num_seqs, max_len, 2 * num_kv_heads, self.head_dim)
        keys, values = kv[:, :, :num_kv_heads].transpose(1, 2), kv[:, :, num_kv_heads:].transpose(1, 2)
        n = batch.max_query_len
        if n == 1:  # decode: one query per sequence, no padding
            # The query heads of one KV head go in as that head's queries: the kernel then runs
            # once per KV head instead of once per query head (10-20% faster on CPU).
            group = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(group, keys, values, attn_mask=batch.mask, scale=self.scale)
            return out.reshape(num_seqs, self.q_size)
        if batch.q_pad_index is not None:
            q = q.index_select(0, batch.q_pad_index)
        queries = q.reshape(num_seqs, n, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask, scale=self.scale,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(num_seqs * n, self.q_size)
        if batch.q_unpad_index is not None:
            out = out.index_select(0, batch.q_unpad_index)
        return out


    def _attend_each(self, q: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """One attention call per sequence: memory in the sum of queries x keys, not in the padded product."""
        num_kv_heads = self.num_kv_heads
        outs = []
        for (first, num_queries, num_keys, mask), row in zip(batch.sequences, batch.kv_indices):
            kv = self.kv_cache.index_select(0, row[:num_keys]).transpose(0, 1).unsqueeze(0)  # [1, 2Hkv, K, D]
            queries = q[first:first + num_queries].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(queries, kv[:, :num_kv_heads], kv[:, num_kv_heads:], attn_mask=mask,
                                                 is_causal=mask is None, scale=self.scale, enable_gqa=True)
            outs.append(out.squeeze(0).transpose(0, 1).reshape(num_queries, self.q_size))
        return torch.cat(outs)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)
        self.gate_up = self.gate_up_proj.project
        self.down = self.down_proj.project

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

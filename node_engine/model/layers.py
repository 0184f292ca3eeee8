"""Building blocks of the Llama/Qwen2 forward pass.

Parameters are created with ``torch.empty`` on the target device and dtype (no
random init): the loader fills them, and the engine allocates them inside the
``weights`` memory region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from node_engine.model.arch import Llama3RopeScaling


def _param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, device=device, dtype=dtype)
        self.bias = _param(out_features, device=device, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers' LlamaRMSNorm, for bitwise-close logits.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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
    survive a release of the weights.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Llama3RopeScaling | None,
                 *, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``: [T, Hq, D], ``k``: [T, Hkv, D], ``cos``/``sin``: [T, D] for the tokens' positions."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@dataclass
class AttentionBatch:
    """How the tokens of one forward step map onto sequences and KV slots.

    Built once per step by the runner and shared by every layer. Tokens are
    flat (``T`` of them, sequences back to back). ``kv_indices`` lists, per
    sequence, the slots of its whole context (cached prefix and the new tokens),
    padded to the longest; ``mask`` hides the padding and, for prefill, the
    future. When every sequence contributes one token (decode) the queries need
    no padding; otherwise ``q_pad_index``/``q_unpad_index`` move them between
    the flat and the padded layout.
    """

    slot_mapping: torch.Tensor        # [T] slot of each new token
    kv_indices: torch.Tensor          # [B, L] slots of each sequence's context
    mask: torch.Tensor | None         # [B, 1, N, L] bool, True = attend
    num_seqs: int
    max_query_len: int                # N
    q_pad_index: torch.Tensor | None = None    # [B*N] flat token index of each padded query
    q_unpad_index: torch.Tensor | None = None  # [T] padded index of each flat token
    is_causal_self_only: bool = False          # one sequence, no cached prefix: plain causal attention


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
        self.scale = head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None  # [num_slots, Hkv, D], set by the runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, cos, sin)
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        self.k_cache.index_copy_(0, batch.slot_mapping, k)
        self.v_cache.index_copy_(0, batch.slot_mapping, v)
        out = self._attend(q, k, v, batch)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = q.shape[0]
        if batch.is_causal_self_only:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return out.squeeze(0).transpose(0, 1).reshape(num_tokens, self.q_size)
        num_seqs, max_len = batch.kv_indices.shape
        flat = batch.kv_indices.reshape(-1)
        keys = self.k_cache.index_select(0, flat).view(num_seqs, max_len, self.num_kv_heads, self.head_dim)
        values = self.v_cache.index_select(0, flat).view(num_seqs, max_len, self.num_kv_heads, self.head_dim)
        n = batch.max_query_len
        if batch.q_pad_index is not None:
            q = q.index_select(0, batch.q_pad_index)
        queries = q.view(num_seqs, n, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.mask, scale=self.scale,
            enable_gqa=True)
        out = out.transpose(1, 2).reshape(num_seqs * n, self.q_size)
        if batch.q_unpad_index is not None:
            out = out.index_select(0, batch.q_unpad_index)
        return out


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

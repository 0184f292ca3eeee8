"""Building blocks of the Llama/Qwen2 forward pass: RMSNorm, attention over the token-slot KV pool
(``AttentionBatch``), the MLP (their projections: ``projection.py``; the rotary table: ``rotary.py``).

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from node_engine.model.projection import Linear, _param
from node_engine.model.rotary import rotate_into


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

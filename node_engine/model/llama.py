"""Llama / Qwen2 decoder over a token-slot KV pool.

q/k/v and gate/up projections are fused into one matrix each; ``hf_weight_map``
says which rows of which parameter every Hugging Face checkpoint key fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from node_engine.model.arch import ModelArch
from node_engine.model.layers import MLP, Attention, AttentionBatch, RMSNorm, rms_norm
from node_engine.model.projection import Projection, _param
from node_engine.model.rotary import RotaryTable


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device=device, dtype=dtype)
        self.self_attn = Attention(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                   bias=arch.attention_bias, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size, device=device, dtype=dtype)
        # Plain references for the hot path (see layers.py).
        self.eps = arch.rms_norm_eps
        self.norm_weights = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        self.attention = self.self_attn.forward
        self.feed_forward = self.mlp.forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        input_norm_weight, post_norm_weight = self.norm_weights
        x = x + self.attention(rms_norm(x, input_norm_weight, self.eps), cos, sin, batch)
        return x + self.feed_forward(rms_norm(x, post_norm_weight, self.eps))


class DecoderStack(nn.Module):
    def __init__(self, arch: ModelArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(arch.vocab_size, arch.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, device=device, dtype=dtype) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, device=device, dtype=dtype)


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, and optionally a row range of it."""

    param_name: str
    row_start: int | None = None
    row_end: int | None = None


class CausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm, LM head."""

    def __init__(self, arch: ModelArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderStack(arch, device=device, dtype=dtype)
        if arch.tie_word_embeddings:
            self.lm_head_weight = self.model.embed_tokens.weight
        else:
            self.lm_head = nn.Module()
            self.lm_head.weight = _param(arch.vocab_size, arch.hidden_size, device=device, dtype=dtype)
            self.lm_head_weight = self.lm_head.weight
        self.logits_head = Projection(self.lm_head_weight, None)
        self.rotary: RotaryTable | None = None  # bound by the runner, outside every memory region

    def bind_rotary(self, rotary: RotaryTable) -> None:
        self.rotary = rotary

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each layer its [num_slots, 2 * num_kv_heads, head_dim] part of the KV pool."""
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = kv_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, *,
                embeds: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat tokens ``input_ids`` at ``positions``.

        ``embeds`` replaces the token embeddings (images scattered in) and ``rope`` the cos/sin of
        ``positions`` (multimodal positions); the vision-language runner passes both for a prefill.
        Callers run it under ``torch.inference_mode`` (the runner enters it once per step).
        """
        if self.rotary is None:
            raise RuntimeError("the rotary table is not bound: call bind_rotary first")
        cos, sin = self.rotary.lookup(positions) if rope is None else rope
        x = F.embedding(input_ids, self.model.embed_tokens.weight) if embeds is None else embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, V] of hidden states [T, hidden]."""
        logits = self.logits_head(hidden)
        return logits if logits.dtype is torch.float32 else logits.float()

    def packable_projections(self) -> list[Projection]:
        """The oneDNN projections whose weights only the forward pass reads (see ``packing.py``).

        A tied LM head is left out: its weight is also the embedding table, which is read as is.
        """
        projections = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections += [attn.qkv, attn.o, mlp.gate_up, mlp.down]
        if not self.arch.tie_word_embeddings:
            projections.append(self.logits_head)
        return [p for p in projections if p.is_onednn]

    def hf_weight_map(self) -> dict[str, WeightTarget]:
        """Every Hugging Face key this model needs, mapped to where it is stored."""
        arch = self.arch
        q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
        mapping: dict[str, WeightTarget] = {
            "model.embed_tokens.weight": WeightTarget("model.embed_tokens.weight"),
            "model.norm.weight": WeightTarget("model.norm.weight"),
        }
        if not arch.tie_word_embeddings:
            mapping["lm_head.weight"] = WeightTarget("lm_head.weight")
        for i in range(arch.num_layers):
            hf = f"model.layers.{i}"
            ours = f"model.layers.{i}"
            mapping[f"{hf}.input_layernorm.weight"] = WeightTarget(f"{ours}.input_layernorm.weight")
            mapping[f"{hf}.post_attention_layernorm.weight"] = WeightTarget(f"{ours}.post_attention_layernorm.weight")
            suffixes = ("weight", "bias") if arch.attention_bias else ("weight",)
            for suffix in suffixes:
                fused = f"{ours}.self_attn.qkv_proj.{suffix}"
                mapping[f"{hf}.self_attn.q_proj.{suffix}"] = WeightTarget(fused, 0, q)
                mapping[f"{hf}.self_attn.k_proj.{suffix}"] = WeightTarget(fused, q, q + kv)
                mapping[f"{hf}.self_attn.v_proj.{suffix}"] = WeightTarget(fused, q + kv, q + 2 * kv)
            mapping[f"{hf}.self_attn.o_proj.weight"] = WeightTarget(f"{ours}.self_attn.o_proj.weight")
            fused = f"{ours}.mlp.gate_up_proj.weight"
            mapping[f"{hf}.mlp.gate_proj.weight"] = WeightTarget(fused, 0, inter)
            mapping[f"{hf}.mlp.up_proj.weight"] = WeightTarget(fused, inter, 2 * inter)
            mapping[f"{hf}.mlp.down_proj.weight"] = WeightTarget(f"{ours}.mlp.down_proj.weight")
        return mapping

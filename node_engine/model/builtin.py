"""``builtin:tiny``: a small Llama-shaped model with seeded random weights and a byte tokenizer.

The same seed gives the same weights on every machine (they are drawn on the
CPU generator, then moved). ``save_checkpoint`` writes any model in the
Hugging Face layout (config.json, model.safetensors, tokenizer files), which is
how the demo and the tests make checkpoints to reload.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from node_engine.model.arch import ModelArch, ModelConfigError

BUILTIN_PREFIX = "builtin:"
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 320  # 256 bytes, <bos>, <eos>, the rest reserved (padded for alignment)

_BUILTINS: dict[str, ModelArch] = {
    "tiny": ModelArch(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=128, intermediate_size=352,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,)),
}

_OVERRIDABLE = {"hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "max_position_embeddings", "tie_word_embeddings", "rope_theta", "attention_bias"}


def is_builtin(model_path: str) -> bool:
    return model_path.startswith(BUILTIN_PREFIX)


def builtin_arch(model_path: str, overrides: dict[str, Any] | None = None) -> ModelArch:
    name = model_path[len(BUILTIN_PREFIX):]
    if name not in _BUILTINS:
        raise ModelConfigError(f"unknown built-in model {model_path!r}; available: "
                               + ", ".join(BUILTIN_PREFIX + n for n in _BUILTINS))
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - _OVERRIDABLE)
    if unknown:
        raise ModelConfigError(f"--model-override has fields that cannot be overridden: {', '.join(unknown)}")
    return replace(_BUILTINS[name], **overrides)


def builtin_weights(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights keyed like a Hugging Face checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    h, i, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(h, std=0.05)

    tensors = {"model.embed_tokens.weight": normal(arch.vocab_size, h, std=1.0)}
    for n in range(arch.num_layers):
        p = f"model.layers.{n}"
        tensors[f"{p}.input_layernorm.weight"] = norm_weight()
        tensors[f"{p}.self_attn.q_proj.weight"] = normal(q, h, std=h ** -0.5)
        tensors[f"{p}.self_attn.k_proj.weight"] = normal(kv, h, std=h ** -0.5)
        tensors[f"{p}.self_attn.v_proj.weight"] = normal(kv, h, std=h ** -0.5)
        if arch.attention_bias:
            tensors[f"{p}.self_attn.q_proj.bias"] = normal(q)
            tensors[f"{p}.self_attn.k_proj.bias"] = normal(kv)
            tensors[f"{p}.self_attn.v_proj.bias"] = normal(kv)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal(h, q, std=q ** -0.5)
        tensors[f"{p}.post_attention_layernorm.weight"] = norm_weight()
        tensors[f"{p}.mlp.gate_proj.weight"] = normal(i, h, std=h ** -0.5)
        tensors[f"{p}.mlp.up_proj.weight"] = normal(i, h, std=h ** -0.5)
        tensors[f"{p}.mlp.down_proj.weight"] = normal(h, i, std=i ** -0.5)
    tensors["model.norm.weight"] = norm_weight()
    if not arch.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(arch.vocab_size, h, std=h ** -0.5)
    return tensors


def hf_config(arch: ModelArch) -> dict[str, Any]:
    """``config.json`` content for ``arch``, readable by transformers and by ``ModelArch.from_hf_config``."""
    config: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": "llama" if arch.architecture == "LlamaForCausalLM" else "qwen2",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch.architecture == "LlamaForCausalLM":
        config["attention_bias"] = arch.attention_bias
    if arch.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **asdict(arch.rope_scaling)}
    if arch.bos_token_id is not None:
        config["bos_token_id"] = arch.bos_token_id
    if arch.eos_token_ids:
        config["eos_token_id"] = list(arch.eos_token_ids) if len(arch.eos_token_ids) > 1 else arch.eos_token_ids[0]
    return config


def save_checkpoint(folder: Path, arch: ModelArch, tensors: dict[str, torch.Tensor], *,
                    with_byte_tokenizer: bool = True, max_shard_bytes: int | None = None) -> None:
    """Write a Hugging Face-shaped checkpoint folder (sharded with an index past ``max_shard_bytes``)."""
    from node_engine.tokenizer import write_byte_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(arch), indent=2))
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key in sorted(tensors):
            nbytes = tensors[key].nbytes
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = tensors[key]
            size += nbytes
        weight_map = {}
        for n, shard in enumerate(shards, start=1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name))
            weight_map.update({key: name for key in shard})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                        "weight_map": weight_map}, indent=2))
    if with_byte_tokenizer:
        write_byte_tokenizer(folder)

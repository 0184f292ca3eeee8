"""``builtin:tiny``: a small Llama-shaped model with seeded random weights and a byte tokenizer.

The same seed gives the same weights on every machine (they are drawn on the
CPU generator, then moved). ``save_checkpoint`` writes any model in the
Hugging Face layout (config.json, model.safetensors, tokenizer files), which is
how the demo and the tests make checkpoints to reload.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from node_engine.model.arch import ModelArch
from node_engine.model.builtin_arch import (BUILTIN_PREFIX, BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE, IMAGE_PAD_ID,
                                            VIDEO_PAD_ID, VISION_END_ID, VISION_SPECIAL_TOKENS, VISION_START_ID,
                                            builtin_arch, is_builtin, mrope_section_for)
from node_engine.vision.arch import hf_vision_config
from node_engine.vision.model import vision_weight_shapes
from node_engine.vision.processor import ProcessorConfig

__all__ = ["BUILTIN_PREFIX", "BUILTIN_PROCESSOR", "BYTE_BOS_ID", "BYTE_EOS_ID", "BYTE_VOCAB_SIZE", "IMAGE_PAD_ID",
           "VIDEO_PAD_ID", "VISION_END_ID", "VISION_SPECIAL_TOKENS", "VISION_START_ID", "builtin_arch",
           "builtin_weights", "hf_config", "is_builtin", "mrope_section_for", "save_checkpoint"]

# The built-in VL model's image processor: Qwen2-VL's, with at most 256 tokens per image.
BUILTIN_PROCESSOR = ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 256)


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
    for key, shape in vision_weight_shapes(arch).items():
        if key.endswith(".bias"):
            tensors[key] = normal(*shape)
        elif len(shape) == 1:  # a norm's scale
            tensors[key] = 1.0 + normal(*shape, std=0.05)
        else:
            fan_in = 1
            for n in shape[1:]:
                fan_in *= n
            tensors[key] = normal(*shape, std=fan_in ** -0.5)
    return tensors


def hf_config(arch: ModelArch) -> dict[str, Any]:
    """``config.json`` content for ``arch``, readable by transformers and by ``ModelArch.from_hf_config``."""
    if arch.vision is not None:
        return _hf_vl_config(arch)
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


def _hf_vl_config(arch: ModelArch) -> dict[str, Any]:
    """A vision-language ``config.json`` in the layout transformers 5 writes (text and vision nested)."""
    vision = arch.vision
    if vision is None:
        raise ValueError("not a vision-language architecture")
    text = {
        "model_type": "qwen2_5_vl_text" if vision.is_qwen2_5 else "qwen2_vl_text",
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "rms_norm_eps": arch.rms_norm_eps, "max_position_embeddings": arch.max_position_embeddings,
        "hidden_act": "silu", "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta,
                            "mrope_section": list(vision.mrope_section)},
    }
    if arch.bos_token_id is not None:
        text["bos_token_id"] = arch.bos_token_id
    if arch.eos_token_ids:
        text["eos_token_id"] = list(arch.eos_token_ids) if len(arch.eos_token_ids) > 1 else arch.eos_token_ids[0]
    return {
        "architectures": [arch.architecture], "model_type": "qwen2_5_vl" if vision.is_qwen2_5 else "qwen2_vl",
        "text_config": text, "vision_config": hf_vision_config(vision),
        "image_token_id": vision.image_token_id, "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": vision.vision_start_token_id, "vision_end_token_id": vision.vision_end_token_id,
        "tie_word_embeddings": arch.tie_word_embeddings, "torch_dtype": "float32",
    }


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
    if arch.vision is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(BUILTIN_PROCESSOR.to_json(), indent=2))
    if with_byte_tokenizer:
        write_byte_tokenizer(folder, vision=arch.vision is not None)

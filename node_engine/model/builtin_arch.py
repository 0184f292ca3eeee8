"""The built-in models' shapes (``builtin:tiny``, ``builtin:tiny-vl``) and their byte tokenizer's ids, without
torch: what checks a ``--model-path builtin:NAME`` and its ``--model-override`` before anything loads. Their
weights and checkpoints are :mod:`node_engine.model.builtin`'s."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.vision.arch import QWEN2_VL, VisionArch

BUILTIN_PREFIX = "builtin:"
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 320  # 256 bytes, <bos>, <eos>, the rest reserved (padded for alignment)
# The byte tokenizer of a vision-language built-in names three reserved ids (Qwen2-VL's spellings).
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = 258, 259, 260, 261
VISION_SPECIAL_TOKENS = {VISION_START_ID: "<|vision_start|>", VISION_END_ID: "<|vision_end|>",
                         IMAGE_PAD_ID: "<|image_pad|>", VIDEO_PAD_ID: "<|video_pad|>"}


def mrope_section_for(head_dim: int) -> tuple[int, int, int]:
    """Qwen2-VL's split of the rotary frequencies (16/24/24 of 64), for any head size."""
    half = head_dim // 2
    spatial = 3 * half // 8
    return (half - 2 * spatial, spatial, spatial)


_TINY_VISION = VisionArch(
    architecture=QWEN2_VL, depth=2, hidden_size=64, num_heads=2, intermediate_size=128, hidden_act="quick_gelu",
    out_hidden_size=128, in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
    rope_theta=10000.0, image_token_id=IMAGE_PAD_ID, vision_start_token_id=VISION_START_ID,
    vision_end_token_id=VISION_END_ID, mrope_section=mrope_section_for(32))

_BUILTINS: dict[str, ModelArch] = {
    "tiny": ModelArch(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=128, intermediate_size=352,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,)),
    # Qwen2-VL-shaped: the decoder of "tiny" with q/k/v biases and M-RoPE, a two-block vision tower.
    "tiny-vl": ModelArch(
        architecture=QWEN2_VL, vocab_size=BYTE_VOCAB_SIZE, hidden_size=128, intermediate_size=352,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=True,
        bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,), vision=_TINY_VISION),
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
    base = _BUILTINS[name]
    for field, value in overrides.items():
        _check_override_type(field, value, getattr(base, field))
    if base.vision is not None:  # the merger's output and M-RoPE follow the decoder's shape
        head_dim = overrides.get("head_dim", base.head_dim)
        overrides["vision"] = replace(base.vision, out_hidden_size=overrides.get("hidden_size", base.hidden_size),
                                      mrope_section=mrope_section_for(head_dim))
    return replace(base, **overrides)


def _check_override_type(field: str, value: Any, default: Any) -> None:
    """An override has its field's JSON type: a bool for a flag, an integer for a size (``true`` is no 1), a
    number for ``rope_theta``; else :class:`ModelConfigError` naming the field."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ModelConfigError(f"--model-override field {field} must be {_json_type(default)}, got {value!r}"[:200])


def _json_type(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    return "an integer" if isinstance(default, int) else "a number"

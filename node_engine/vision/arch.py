"""The vision tower of a Qwen2-VL / Qwen2.5-VL checkpoint, read from its ``config.json``.

Both layouts of ``config.json`` are read: the one Qwen published (text fields at
the top level, ``rope_scaling: {"type": "mrope", "mrope_section": ...}``) and
the one transformers 5 writes (``text_config`` and ``vision_config`` nested,
``rope_parameters``). Anything the engine cannot run faithfully fails here,
naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node_engine.model.errors import ModelConfigError

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
VL_ARCHITECTURES = (QWEN2_VL, QWEN2_5_VL)
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class VisionArch:
    """What the vision tower, the merger and M-RoPE need; the field names say which model variant uses what."""

    architecture: str               # QWEN2_VL or QWEN2_5_VL
    depth: int
    hidden_size: int                # width of the vision blocks (Qwen2-VL's ``embed_dim``)
    num_heads: int
    intermediate_size: int          # MLP width (Qwen2-VL: ``embed_dim * mlp_ratio``)
    hidden_act: str
    out_hidden_size: int            # the merger's output: the language model's hidden size
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]
    window_size: int = 0                          # Qwen2.5-VL: window attention, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()   # Qwen2.5-VL: the blocks with full attention

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "in_channels",
                     "patch_size", "temporal_patch_size", "spatial_merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"vision_config.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ModelConfigError("vision_config.hidden_size / num_heads must be a multiple of 4 (2-D rotary)")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ModelConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not supported; supported: "
                                   + ", ".join(VISION_ACTIVATIONS))
        if self.is_qwen2_5 and self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ModelConfigError("vision_config.window_size must be a multiple of patch_size * spatial_merge_size")

    @property
    def is_qwen2_5(self) -> bool:
        return self.architecture == QWEN2_5_VL

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one language-model token."""
        return self.spatial_merge_size ** 2

    def num_params(self) -> int:
        h, i, m = self.hidden_size, self.intermediate_size, self.merge_unit * self.hidden_size
        mlp = 3 * h * i + 2 * i + h if self.is_qwen2_5 else 2 * h * i + i + h
        norms = 2 * h if self.is_qwen2_5 else 4 * h
        block = 3 * h * h + 3 * h + h * h + h + mlp + norms
        merger = (h if self.is_qwen2_5 else 2 * h) + m * m + m + m * self.out_hidden_size + self.out_hidden_size
        return self.patch_dim * h + self.depth * block + merger


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: ``text_config`` when nested, else the top level (Qwen's own layout)."""
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, dict):
        raise ModelConfigError("config field text_config must be an object")
    merged = dict(text)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # kept at the top level by some writers
        if key in config and key not in merged:
            merged[key] = config[key]
    if config.get("tie_word_embeddings"):
        merged["tie_word_embeddings"] = True
    return merged


def mrope_section_of(text: dict[str, Any]) -> tuple[int, int, int]:
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            section = params["mrope_section"]
            if (not isinstance(section, list) or len(section) != 3
                    or not all(isinstance(s, int) and s > 0 for s in section)):
                raise ModelConfigError(f"{key}.mrope_section must be three positive integers, got {section!r}")
            return (section[0], section[1], section[2])
    raise ModelConfigError("config.json has no mrope_section (rope_parameters or rope_scaling)")


def vision_arch_from_hf_config(architecture: str, config: dict[str, Any], head_dim: int) -> VisionArch:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelConfigError("config.json is missing the object vision_config")
    section = mrope_section_of(text_config_of(config))
    if 2 * sum(section) != head_dim:
        raise ModelConfigError(f"mrope_section {list(section)} must cover half of head_dim {head_dim}")
    try:
        if architecture == QWEN2_VL:
            width = int(vision.get("embed_dim", 1280))
            fields = dict(hidden_size=width, intermediate_size=int(width * float(vision.get("mlp_ratio", 4))),
                          hidden_act=str(vision.get("hidden_act", "quick_gelu")),
                          out_hidden_size=int(vision["hidden_size"]))
        else:
            fields = dict(hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
                          hidden_act=str(vision.get("hidden_act", "silu")),
                          out_hidden_size=int(vision["out_hidden_size"]),
                          window_size=int(vision.get("window_size", 112)),
                          fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())))
        rope = vision.get("rope_parameters")
        rope_theta = float(rope.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        return VisionArch(
            architecture=architecture, depth=int(vision["depth"]), num_heads=int(vision["num_heads"]),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)), rope_theta=rope_theta,
            image_token_id=int(config["image_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
            vision_end_token_id=int(config["vision_end_token_id"]),
            mrope_section=section, **fields)
    except KeyError as exc:
        raise ModelConfigError(f"config.json is missing the field {exc.args[0]!r} (vision)") from exc
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"config.json has a vision field of the wrong type: {exc}") from exc


def hf_vision_config(vision: VisionArch) -> dict[str, Any]:
    """``vision_config`` for ``vision``, in the layout transformers 5 writes."""
    config: dict[str, Any] = {
        "depth": vision.depth, "num_heads": vision.num_heads, "hidden_act": vision.hidden_act,
        "in_channels": vision.in_channels, "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size, "spatial_merge_size": vision.spatial_merge_size,
        "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
    }
    if vision.is_qwen2_5:
        config.update(model_type="qwen2_5_vl_vision", hidden_size=vision.hidden_size,
                      intermediate_size=vision.intermediate_size, out_hidden_size=vision.out_hidden_size,
                      window_size=vision.window_size, fullatt_block_indexes=list(vision.fullatt_block_indexes),
                      tokens_per_second=4)
    else:
        ratio = vision.intermediate_size / vision.hidden_size
        if ratio != int(ratio):
            raise ValueError("Qwen2-VL's vision MLP width must be a multiple of its hidden size (mlp_ratio)")
        config.update(model_type="qwen2_vl_vision", embed_dim=vision.hidden_size, mlp_ratio=int(ratio),
                      hidden_size=vision.out_hidden_size)
    return config

"""The architecture of a checkpoint, read from its ``config.json``.

Only what the forward pass needs is kept, in one frozen dataclass validated on
construction. Anything the engine cannot run faithfully (an unknown
architecture, an unsupported ``rope_scaling`` type) fails here, at start, with a
message that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handoff.checkpoint.files import FileReader
from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_engine.model.errors import ModelConfigError
from node_engine.vision.arch import VL_ARCHITECTURES, VisionArch, text_config_of, vision_arch_from_hf_config

__all__ = ["ModelArch", "ModelConfigError", "Llama3RopeScaling", "SUPPORTED_ARCHITECTURES"]

MIN_CONTEXT_TOKENS = 8  # the least context that takes a one-token prompt (SGLang: the context less 6)
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config.json is a few KiB; a large one is not a config
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM") + VL_ARCHITECTURES


@dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ModelConfigError(f"rope_scaling.{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ModelConfigError("rope_scaling.high_freq_factor must be > low_freq_factor")


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: Llama3RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    vision: VisionArch | None = None  # Qwen2-VL / Qwen2.5-VL: the vision tower (the text model is Qwen2's)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.max_position_embeddings < MIN_CONTEXT_TOKENS:  # it bounds the context: every prompt refused
            raise ModelConfigError(f"max_position_embeddings must be at least {MIN_CONTEXT_TOKENS} (the least that "
                                   f"takes a one-token prompt), got {self.max_position_embeddings}")
        if self.head_dim % 2:  # the rotary embedding turns pairs of a head's values: an odd one fails every request
            raise ModelConfigError(f"head_dim must be even (rotary embeddings rotate pairs of values), got "
                                   f"{self.head_dim} (hidden_size / num_attention_heads where config.json has none)")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})")
        if not (0 < self.rms_norm_eps < math.inf and 0 < self.rope_theta < math.inf):  # NaN fails both
            raise ModelConfigError(f"rms_norm_eps and rope_theta must be finite numbers > 0, got "
                                   f"{self.rms_norm_eps} and {self.rope_theta}")
        if (self.vision is not None) != (self.architecture in VL_ARCHITECTURES):
            raise ModelConfigError(f"architecture {self.architecture} and its vision tower do not match")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ModelConfigError(f"the vision merger outputs {self.vision.out_hidden_size} values per token, the "
                                   f"language model's hidden size is {self.hidden_size}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        vision = self.vision.num_params() if self.vision is not None else 0
        return v * h + self.num_layers * per_layer + h + head + vision

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelArch":
        archs = config.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
            raise ModelConfigError(f"config.json must name exactly one architecture, got {str(archs)[:200]}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        is_vl = arch in VL_ARCHITECTURES
        outer = config
        if is_vl:
            config = text_config_of(config)
        try:
            num_heads = _integer(config, "num_attention_heads")
            hidden = _integer(config, "hidden_size")
            arch_fields = dict(
                architecture=arch,
                vocab_size=_integer(config, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_integer(config, "intermediate_size"),
                num_layers=_integer(config, "num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=_integer(config, "num_key_value_heads", num_heads),
                head_dim=_integer(config, "head_dim", hidden // num_heads if num_heads > 0 else 0),
                rms_norm_eps=_number(config, "rms_norm_eps", 1e-6),
                rope_theta=_number(_rope_source(config), "rope_theta", 10000.0),
                max_position_embeddings=_integer(config, "max_position_embeddings", 4096),
                tie_word_embeddings=_flag(config, "tie_word_embeddings"),
                # Qwen2 (and the VL models' Qwen2) always has q/k/v biases; Llama only with attention_bias.
                attention_bias=arch != "LlamaForCausalLM" or _flag(config, "attention_bias"),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json is missing the field {exc.args[0]!r}") from exc
        if config.get("hidden_act", "silu") != "silu":  # the MLP computes SiLU(gate) * up, whatever is named
            raise ModelConfigError(f"config field hidden_act={str(config.get('hidden_act'))[:40]!r} is not "
                                   "supported; supported: silu")
        if config.get("mlp_bias"):
            raise ModelConfigError("config field mlp_bias=true is not supported")
        if arch != "LlamaForCausalLM" and config.get("use_sliding_window"):
            raise ModelConfigError("Qwen2 use_sliding_window=true is not supported")
        vision = vision_arch_from_hf_config(arch, outer, arch_fields["head_dim"]) if is_vl else None
        return cls(**arch_fields, rope_scaling=None if is_vl else _parse_rope_scaling(config),
                   bos_token_id=_optional_int(config.get("bos_token_id")),
                   eos_token_ids=_int_tuple(config.get("eos_token_id")), vision=vision)

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelArch":
        path = folder / "config.json"
        reader = FileReader()
        if not reader.exists(path):
            raise ModelConfigError(f"{path} is missing")
        raw = reader.read_small(path, MAX_CONFIG_BYTES)  # a regular file, read to its size: not /proc, not a FIFO
        try:
            config = loads_bounded(raw)
        except PeerJSONError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_config(config, str(path))

    @classmethod
    def from_config(cls, config: object, where: str) -> "ModelArch":
        """:meth:`from_hf_config` for a config read from a file (``where``): whatever is malformed in it, however
        deep in the readers it is met, is a :class:`ModelConfigError` naming the file."""
        if not isinstance(config, dict):
            raise ModelConfigError(f"{where} holds a JSON {type(config).__name__}, not an object")
        try:
            return cls.from_hf_config(config)
        except ModelConfigError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
            raise ModelConfigError(f"{where} has a field of the wrong type or value: {type(exc).__name__}: "
                                   f"{str(exc)[:200]}") from exc


def _rope_source(config: dict[str, Any]) -> dict[str, Any]:
    """Where ``rope_theta`` is: transformers 5's ``rope_parameters``, else the top level."""
    params = config.get("rope_parameters")
    return params if isinstance(params, dict) and "rope_theta" in params else config


def _parse_rope_scaling(config: dict[str, Any]) -> Llama3RopeScaling | None:
    scaling = config.get("rope_scaling")
    if scaling is None:
        params = config.get("rope_parameters")
        if isinstance(params, dict) and params.get("rope_type", "default") != "default":
            scaling = params
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelConfigError(f"rope_scaling type {kind!r} is not supported; supported: llama3")
    try:
        return Llama3RopeScaling(
            factor=_number(scaling, "factor"),
            low_freq_factor=_number(scaling, "low_freq_factor"),
            high_freq_factor=_number(scaling, "high_freq_factor"),
            original_max_position_embeddings=_integer(scaling, "original_max_position_embeddings"),
        )
    except KeyError as exc:
        raise ModelConfigError(f"rope_scaling of type llama3 is missing {exc.args[0]!r}") from exc


def _integer(config: dict[str, Any], name: str, default: int | None = None) -> int:
    """A size field: a JSON integer (``2048.0`` too), never a boolean, a fraction or a string; a missing or null
    field is ``default`` (None: required)."""
    value = config.get(name)
    if value is None:
        if default is None:
            raise KeyError(name)
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelConfigError(f"config field {name} must be an integer, got {str(value)[:40]!r}")
    return value


def _number(config: dict[str, Any], name: str, default: float | None = None) -> float:
    value = config.get(name)
    if value is None:
        if default is None:
            raise KeyError(name)
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ModelConfigError(f"config field {name} must be a number, got {str(value)[:40]!r}")
    return float(value)


def _flag(config: dict[str, Any], name: str) -> bool:
    value = config.get(name)
    if value is None:  # missing or null: the field's default
        return False
    if not isinstance(value, bool):
        raise ModelConfigError(f"config field {name} must be true or false, got {str(value)[:40]!r}")
    return value


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) else None


def _int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value if isinstance(v, int))
    return ()

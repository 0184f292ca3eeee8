"""Which model the engine serves: its architecture and tokenizer, checked before anything is allocated."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterator

from node_engine.config import ConfigError, EngineConfig
from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.model.builtin import builtin_arch, is_builtin
from node_engine.model.loader import read_header
from node_engine.tokenizer import Tokenizer

VISION_FLAGS = ("max_image_tokens", "visual_batch_max_tokens", "vision_reserve_mb")


def load_model_source(config: EngineConfig) -> tuple[ModelArch, Tokenizer]:
    """Architecture and tokenizer of the configured model; fails early, naming what is wrong."""
    if is_builtin(config.model_path):
        overrides = config.model_override_dict()
        with _naming("--model-override" if overrides else f"--model-path {config.model_path}"):
            arch = builtin_arch(config.model_path, overrides)
        return arch, Tokenizer.builtin_bytes(vision=arch.vision is not None)
    if config.model_override:
        raise ConfigError("--model-override applies to built-in models only")
    folder = Path(config.model_path)
    with _naming(f"--model-path {config.model_path}"):
        arch = ModelArch.from_folder(folder)
        check_sizes(arch, folder)  # before anything is allocated for the sizes config.json gives
        tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=arch.eos_token_ids)
        if tokenizer.vocab_size > arch.vocab_size:
            raise ModelConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
                                   f"{arch.vocab_size}")
        outside = [i for i in tokenizer.eos_token_ids if not 0 <= i < arch.vocab_size]
        if outside:  # a stop token past the logits: min_new_tokens would index out of them
            raise ModelConfigError(f"eos_token_id {outside[0]} is not a token of the model's {arch.vocab_size}")
    return arch, tokenizer


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def check_sizes(arch: ModelArch, folder: Path) -> None:
    """The sizes ``config.json`` gives, checked against the checkpoint's headers before anything is allocated
    for them: as many decoder layers as the checkpoint holds, and the shapes of the embeddings and of layer 0
    (every layer's are the same). A config of a billion layers or a vocabulary of 2^40 is one clear error, not
    an allocation of that size; what else is wrong (missing keys too) is named once the model is allocated
    (:func:`~node_engine.model.loader.load_weights`)."""
    entries = read_header(folder)
    layers = {int(match.group(1)) for key in entries if (match := _LAYER_KEY.match(key))}
    if len(layers) != arch.num_layers or max(layers) != arch.num_layers - 1:  # distinct: 0 to num_layers - 1
        held = f"layers 0 to {max(layers)}" if layers and max(layers) == len(layers) - 1 else f"{len(layers)} layers"
        raise ModelConfigError(f"config.json gives num_hidden_layers {arch.num_layers}; the checkpoint holds "
                               f"{held if layers else 'no layers'}")
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    expected = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.layers.0.self_attn.q_proj.weight": (q, h),
                "model.layers.0.self_attn.k_proj.weight": (kv, h), "model.layers.0.self_attn.o_proj.weight": (h, q),
                "model.layers.0.mlp.gate_proj.weight": (inter, h), "model.layers.0.mlp.down_proj.weight": (h, inter)}
    wrong = [f"{key} has shape {list(entries[key].shape)}, config.json gives {list(shape)}"
             for key, shape in expected.items() if key in entries and entries[key].shape != shape]
    if wrong:
        raise ModelConfigError("the checkpoint does not match its config.json: " + "; ".join(wrong))


@contextlib.contextmanager
def _naming(flag: str) -> Iterator[None]:
    """A model the engine cannot serve is refused in one line that names the flag which chose it."""
    try:
        yield
    except ModelConfigError as exc:
        if str(exc).startswith("--"):
            raise
        raise type(exc)(f"{flag}: {exc}") from exc


def check_vision_flags(config: EngineConfig, arch: ModelArch) -> None:
    """The vision flags name a model with a vision tower, and nothing it cannot run with yet."""
    if arch.vision is None:
        given = [name for name in VISION_FLAGS if getattr(config, name) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} is for vision-language models; {config.model_path} "
                              "has no vision tower")
    elif config.enable_torch_compile:
        raise ConfigError("--enable-torch-compile is not available for vision-language models yet (M-RoPE "
                          "positions differ from token positions in decode)")

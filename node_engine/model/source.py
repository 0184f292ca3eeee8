"""Which model the engine serves: its architecture and tokenizer, checked before anything is allocated."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from node_engine.config import ConfigError, EngineConfig
from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.model.builtin import builtin_arch, is_builtin
from node_engine.model.loader import checkpoint_files
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
        checkpoint_files(folder)
        tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=arch.eos_token_ids)
        if tokenizer.vocab_size > arch.vocab_size:
            raise ModelConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
                                   f"{arch.vocab_size}")
    return arch, tokenizer


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

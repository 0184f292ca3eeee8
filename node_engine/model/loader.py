"""Load Hugging Face safetensors checkpoints into a :class:`CausalLM`, at start and in place.

Loading at start converts each tensor to the engine's dtype and remembers the
checkpoint's own dtype per key. A reload (``update_weights_from_disk``) is
checked in full before any byte is copied: same keys, same shapes, same
checkpoint dtypes; only then are the tensors copied into the existing
parameters (so CUDA graphs that captured their addresses stay valid).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.model.llama import CausalLM, WeightTarget

# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_KEYS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


# transformers 5 may write a vision-language checkpoint's keys under these prefixes; the engine reads
# both spellings and names them the way Qwen published them.
_KEY_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str = ""  # the key in the file, when it differs from the engine's name for it


def canonical_key(key: str) -> str:
    for prefix, replacement in _KEY_ALIASES:
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return key


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: from its index when present."""
    if not folder.is_dir():
        raise ModelConfigError(f"model folder {folder} does not exist")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelConfigError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"{index.name} names shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"no *.safetensors file in {folder}")
    return files


def read_header(folder: Path) -> dict[str, TensorEntry]:
    """Key → (file, shape, dtype) for every tensor of the checkpoint, reading headers only."""
    entries: dict[str, TensorEntry] = {}
    for path in checkpoint_files(folder):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    tensor_slice = f.get_slice(key)
                    dtype_name = tensor_slice.get_dtype()
                    if dtype_name not in _SAFETENSORS_DTYPES:
                        raise ModelConfigError(f"{path.name}: tensor {key} has unsupported dtype {dtype_name}")
                    entries[canonical_key(key)] = TensorEntry(path, tuple(tensor_slice.get_shape()),
                                                              _SAFETENSORS_DTYPES[dtype_name], name=key)
        except ModelConfigError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelConfigError(f"cannot read {path.name}: {exc}") from exc
    return entries


def _check_keys(model: CausalLM, entries: dict[str, TensorEntry]) -> dict[str, WeightTarget]:
    targets = model.hf_weight_map()
    found = {k for k in entries if not _IGNORED_KEYS.match(k)}
    if model.arch.tie_word_embeddings:
        found.discard("lm_head.weight")
    missing = sorted(set(targets) - found)
    unexpected = sorted(found - set(targets))
    problems = []
    if missing:
        problems.append(f"missing weight keys: {_short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected weight keys: {_short_list(unexpected)}")
    if problems:
        raise ModelConfigError("; ".join(problems))
    return targets


def _short_list(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _target_view(params: dict[str, torch.Tensor], target: WeightTarget) -> torch.Tensor:
    param = params[target.param_name]
    if target.row_start is None:
        return param
    return param[target.row_start:target.row_end]


def _target_shape(params: dict[str, torch.Tensor], target: WeightTarget) -> tuple[int, ...]:
    """The shape of a target from metadata alone: a released or packed parameter has no storage to slice."""
    shape = tuple(params[target.param_name].shape)
    if target.row_start is None:
        return shape
    row_end = shape[0] if target.row_end is None else target.row_end
    return (row_end - target.row_start,) + shape[1:]


def _check_shapes(model: CausalLM, entries: dict[str, TensorEntry], targets: dict[str, WeightTarget]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    wrong = []
    for key, target in targets.items():
        expected = _target_shape(params, target)
        if entries[key].shape != expected:
            wrong.append(f"{key} has shape {list(entries[key].shape)}, expected {list(expected)}")
    if wrong:
        raise ModelConfigError("wrong tensor shapes: " + "; ".join(wrong[:8]))


def load_weights(model: CausalLM, folder: Path) -> dict[str, torch.dtype]:
    """Fill ``model``'s parameters from ``folder``; returns the checkpoint dtype of each key."""
    entries = read_header(folder)
    targets = _check_keys(model, entries)
    _check_shapes(model, entries, targets)
    _copy(model, entries, targets)
    return {key: entries[key].dtype for key in targets}


def load_tensors(model: CausalLM, tensors: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """Fill ``model``'s parameters from in-memory tensors keyed like a checkpoint."""
    targets = model.hf_weight_map()
    entries = {k: TensorEntry(Path("<memory>"), tuple(t.shape), t.dtype) for k, t in tensors.items()}
    _check_keys(model, entries)
    _check_shapes(model, entries, targets)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, target in targets.items():
            view = _target_view(params, target)
            view.copy_(tensors[key].to(device=view.device, dtype=view.dtype))
    return {key: tensors[key].dtype for key in targets}


def check_update(model: CausalLM, folder: Path, source_dtypes: dict[str, torch.dtype]) -> dict[str, TensorEntry]:
    """Validate a reload of ``folder`` against the running model without touching it."""
    config = folder / "config.json"
    if config.is_file():
        new_arch = ModelArch.from_folder(folder)
        if _shape_signature(new_arch) != _shape_signature(model.arch):
            raise ModelConfigError(f"{config} describes a different architecture than the running model")
    entries = read_header(folder)
    targets = _check_keys(model, entries)
    _check_shapes(model, entries, targets)
    wrong = [f"{key} is {entries[key].dtype}, the running checkpoint had {source_dtypes[key]}"
             for key in targets if key in source_dtypes and entries[key].dtype != source_dtypes[key]]
    if wrong:
        raise ModelConfigError("wrong tensor dtypes: " + "; ".join(wrong[:8]))
    return entries


def apply_update(model: CausalLM, entries: dict[str, TensorEntry]) -> None:
    """Copy a checked checkpoint into the model's existing parameters."""
    _copy(model, entries, model.hf_weight_map())


def _copy(model: CausalLM, entries: dict[str, TensorEntry], targets: dict[str, WeightTarget]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    by_file: dict[Path, list[str]] = {}
    for key in targets:
        by_file.setdefault(entries[key].file, []).append(key)
    with torch.no_grad():
        for path, keys in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in keys:
                    view = _target_view(params, targets[key])
                    view.copy_(f.get_tensor(entries[key].name or key).to(dtype=view.dtype), non_blocking=False)


def _shape_signature(arch: ModelArch) -> tuple:
    return (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers,
            arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings, arch.attention_bias,
            arch.vision)

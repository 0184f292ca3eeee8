"""Load Hugging Face safetensors checkpoints into a :class:`CausalLM`, at start and in place.

Files are read by :class:`~node_engine.model.checkpoint_io.CheckpointReader`
(regular files only, GIL-free reads). Loading at start converts each tensor to
the engine's dtype and remembers the checkpoint's own dtype per key. A reload
(``update_weights_from_disk``) is checked in full before any byte is read:
same keys, same shapes, same checkpoint dtypes; then every tensor is staged in
host memory, or on the GPU when it has room (:func:`stage_update`, off the
engine thread, bounded by the caller), and only a completely staged checkpoint is copied into the existing
parameters (:func:`apply_staged`), so CUDA graphs that captured their
addresses stay valid and a stalled read never leaves the model half loaded.
"""

from __future__ import annotations

import logging
import re
import threading
import traceback
from pathlib import Path

import torch

from handoff.checkpoint.files import shown
from handoff.checkpoint.safetensors_header import read_folder_headers
from node_engine.model.arch import ModelArch, ModelConfigError
from node_engine.model.checkpoint_io import CheckpointError, CheckpointReader, TensorEntry
from node_engine.model.llama import CausalLM, WeightTarget

log = logging.getLogger(__name__)

STAGING_HEADROOM_BYTES = 1 << 30  # device memory a reload staged on the GPU leaves free for the engine's work

# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_KEYS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

__all__ = ["TensorEntry", "checkpoint_files", "read_header", "load_weights", "load_tensors", "check_update",
           "stage_update", "apply_staged", "check_named_tensors", "is_dropped_key", "touched_parameters",
           "by_checkpoint_key"]


# transformers 5 may write a vision-language checkpoint's keys under these prefixes; the engine reads
# both spellings and names them the way Qwen published them.
_KEY_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def canonical_key(key: str) -> str:
    for prefix, replacement in _KEY_ALIASES:
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return key


def checkpoint_files(folder: Path, reader: CheckpointReader | None = None) -> list[Path]:
    """The safetensors files of a checkpoint folder: from its index when present."""
    return (reader or CheckpointReader()).shard_files(folder)


def read_header(folder: Path, reader: CheckpointReader | None = None) -> dict[str, TensorEntry]:
    """Key → where and what, for every tensor of the checkpoint, reading headers only."""
    reader = reader or CheckpointReader()
    entries: dict[str, TensorEntry] = {}
    for name, entry in read_folder_headers(reader, folder).items():
        key = canonical_key(name)
        if key in entries:
            raise CheckpointError(f"tensor {key} is in the checkpoint under two names ({name} is one)")
        entries[key] = reader.entry(name, entry)
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
    listed = ", ".join(shown(key) for key in keys[:limit])  # a checkpoint's key may be megabytes long
    return listed + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


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


def load_weights(model: CausalLM, folder: Path, reader: CheckpointReader | None = None) -> dict[str, torch.dtype]:
    """Fill ``model``'s parameters from ``folder`` (one tensor in memory at a time); returns checkpoint dtypes."""
    reader = reader or CheckpointReader()
    entries = read_header(folder, reader)
    targets = _check_keys(model, entries)
    _check_shapes(model, entries, targets)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, tensor in reader.iter_tensors(entries, list(targets)):
            view = _target_view(params, targets[key])
            view.copy_(tensor.to(dtype=view.dtype))
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


def check_update(model: CausalLM, folder: Path, source_dtypes: dict[str, torch.dtype],
                 reader: CheckpointReader | None = None) -> dict[str, TensorEntry]:
    """Validate a reload of ``folder`` against the running model without touching it (headers only)."""
    reader = reader or CheckpointReader()
    config = folder / "config.json"
    if reader.exists(config):
        new_arch = ModelArch.from_config(reader.read_json(config), str(config))
        if _shape_signature(new_arch) != _shape_signature(model.arch):
            raise ModelConfigError(f"{config} describes a different architecture than the running model")
    entries = read_header(folder, reader)
    targets = _check_keys(model, entries)
    _check_shapes(model, entries, targets)
    wrong = [f"{key} is {entries[key].dtype}, the running checkpoint had {source_dtypes[key]}"
             for key in targets if key in source_dtypes and entries[key].dtype != source_dtypes[key]]
    if wrong:
        raise ModelConfigError("wrong tensor dtypes: " + "; ".join(wrong[:8]))
    return entries


def stage_update(model: CausalLM, entries: dict[str, TensorEntry], reader: CheckpointReader,
                 into: dict[str, torch.Tensor], cancel: threading.Event | None = None, *,
                 on_device: bool = False) -> None:
    """Read every tensor a checked reload needs into ``into`` (the model is not touched): into host memory, or
    with ``on_device`` onto the model's CUDA device when its free memory holds them with ``STAGING_HEADROOM_BYTES``
    to spare (the commit then copies device to device; an allocation that fails all the same falls back).

    ``into`` is the caller's, so that a caller that stops waiting (a read stalled past its deadline) can let go of
    what was staged. A staging on the device that fails empties ``into`` and gives its memory back to the device.
    """
    keys = list(model.hf_weight_map())
    device = next(model.parameters()).device
    if on_device and device.type == "cuda":
        num_bytes = sum(entries[key].num_bytes for key in keys)
        if torch.cuda.mem_get_info(device)[0] >= num_bytes + STAGING_HEADROOM_BYTES:
            try:
                into.update(reader.iter_tensors_on(device, entries, keys, cancel))
                return
            except BaseException as exc:
                traceback.clear_frames(exc.__traceback__)  # the tensor being read, held by the read's frame
                into.clear()
                torch.cuda.empty_cache()  # blocks cached for the staging's own stream: no one else reuses them
                if not isinstance(exc, torch.OutOfMemoryError):
                    raise
            log.warning("staging a reload on %s ran out of memory; reading it into host memory", device)
    into.update(reader.iter_tensors(entries, keys, cancel))


def by_checkpoint_key(model: CausalLM, named: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Checkpoint keys for every tensor: a fused parameter's name (SGLang's ``direct`` format names
    ``qkv_proj`` and ``gate_up_proj``) becomes the checkpoint tensors it holds, as row views, and a
    vision-language model's names as transformers 5 holds them in memory (``model.language_model.``,
    ``model.visual.``: what a trainer's ``state_dict()`` pushes) become the published ones."""
    fused: dict[str, list[tuple[str, WeightTarget]]] = {}
    for key, target in model.hf_weight_map().items():
        if target.row_start is not None:
            fused.setdefault(target.param_name, []).append((key, target))
    out: list[tuple[str, object]] = []
    for name, tensor in named:
        name = canonical_key(name)
        parts = fused.get(name)
        if parts is None or not isinstance(tensor, torch.Tensor):
            out.append((name, tensor))
            continue
        rows = parts[-1][1].row_end
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            out.append((name, tensor))  # the shape check names it
            continue
        out.extend((key, tensor[target.row_start:target.row_end]) for key, target in parts)
    return out


def is_dropped_key(model: CausalLM, name: str) -> bool:
    """Whether an update's tensor of this name is taken and dropped, as at load: rotary buffers, and
    ``lm_head.weight`` of a model with tied embeddings."""
    name = canonical_key(name)
    return bool(_IGNORED_KEYS.match(name)) or (model.arch.tie_word_embeddings and name == "lm_head.weight")


def check_named_tensors(model: CausalLM, named: list[tuple[str, object]]) -> dict[str, torch.Tensor]:
    """Checkpoint-keyed tensors of a weight update (all of the weights, or a bucket of them), checked against
    the running model without touching it: known keys, each once, the target's shape, a floating dtype.

    ``lm_head.weight`` of a model with tied embeddings and rotary buffers are
    dropped, as at load. Raises :class:`ModelConfigError` naming every problem.
    """
    targets = model.hf_weight_map()
    params = dict(model.named_parameters(remove_duplicate=False))
    checked: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, tensor in named:
        if is_dropped_key(model, name):
            continue
        named_as = shown(name)  # the caller's to choose: a name of megabytes is not echoed whole
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{named_as} is a {type(tensor).__name__}, not a tensor")
        elif name in checked:
            problems.append(f"{named_as} is listed twice")
        elif name not in targets:
            problems.append(f"unknown weight {named_as}")
        elif tuple(tensor.shape) != _target_shape(params, targets[name]):
            problems.append(f"{named_as} has shape {list(tensor.shape)}, expected "
                            f"{list(_target_shape(params, targets[name]))}")
        elif not tensor.dtype.is_floating_point:
            problems.append(f"{named_as} has dtype {tensor.dtype}; weights are floating point")
        else:
            checked[name] = tensor
    if problems:
        raise ModelConfigError(f"{len(problems)} problem(s), nothing was loaded: " + "; ".join(problems[:8]))
    return checked


def touched_parameters(model: CausalLM, keys: list[str]) -> list[torch.Tensor]:
    """The parameters that writing ``keys`` changes."""
    targets = model.hf_weight_map()
    params = dict(model.named_parameters(remove_duplicate=False))
    return list({targets[key].param_name: params[targets[key].param_name] for key in keys}.values())


def apply_staged(model: CausalLM, staged: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors (all of the weights, or some) into the model's existing parameters.

    ``copy_`` converts dtype and device as it copies, so nothing is allocated
    here and, once the tensors are checked, nothing can fail half way for a
    reason of the request's making.
    """
    targets = model.hf_weight_map()
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, tensor in staged.items():
            _target_view(params, targets[key]).copy_(tensor, non_blocking=False)


def _shape_signature(arch: ModelArch) -> tuple:
    return (arch.architecture, arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers,
            arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings, arch.attention_bias,
            arch.vision)

"""A checkpoint folder checked by the sidecar before a foreign engine loads it.

vLLM reloads weights in place and, when a checkpoint does not fit (a missing
path, another architecture, a tensor of another shape), fails half way with
its parameters gone: the next request kills the engine. SGLang has no dry
run. So before such an engine is drained and asked to load, the sidecar reads
the folder itself (it must see the engine's filesystem: same host, or the same
volume in a pod) and compares it with the checkpoint the engine serves:
``config.json``'s shape fields, then every tensor's name and shape from the
safetensors headers (read without loading any tensor). A difference is a 400
naming it, and the node goes on serving.

The folder is read by the engine's own rules (:mod:`handoff.checkpoint`): regular
files only, GIL-free reads, bounded sizes, and each header checked exactly as
the ``safetensors`` library checks it when the engine opens the file, so a
truncated shard or a header the library refuses is a 400 here, before the
engine has loaded any of the other shards. The caller bounds the reading in
time (:data:`CHECK_TIMEOUT_S`): a folder on a hung mount is a clear error, not a
request that never ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handoff.checkpoint.errors import ModelConfigError
from handoff.checkpoint.files import FileReader, shown
from handoff.checkpoint.safetensors_header import read_folder_headers, shown_shape
from handoff.service.errors import InvalidRequest

CHECK_TIMEOUT_S = 60.0  # reading a folder's headers; a healthy mount takes well under a second
SHAPE_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


@dataclass(frozen=True)
class CheckpointShape:
    """What must match for an in-place reload: the config's shape fields and each tensor's shape."""

    path: str
    config: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]


def read_checkpoint(path: str) -> CheckpointShape:
    """The shape of the checkpoint folder at ``path``; InvalidRequest saying what is missing or unreadable.

    Blocking (file reads): run it on a thread with a deadline.
    """
    folder, reader = Path(path), FileReader()
    try:
        if not reader.is_dir(folder):
            raise InvalidRequest(f"model_path {shown(path)!r} is not a folder the node can read (the sidecar checks "
                                 "the checkpoint on the engine's filesystem before the engine loads it)")
        config = reader.read_json(folder / "config.json")
        if not isinstance(config, dict):
            raise InvalidRequest(f"{shown(folder / 'config.json')} is not a JSON object")
        tensors = {name: entry.shape for name, entry in read_folder_headers(reader, folder).items()}
    except ModelConfigError as exc:
        raise InvalidRequest(f"model_path {shown(path)!r} cannot be loaded: {exc}") from exc
    return CheckpointShape(path, {k: config.get(k) for k in SHAPE_FIELDS}, tensors)


def check_compatible(new: CheckpointShape, current: CheckpointShape) -> None:
    """InvalidRequest naming the first difference between a checkpoint and the one being served."""
    # what a checkpoint holds is shown cut, as its path is: a config value or a tensor name may be megabytes long
    path = shown(new.path)
    for key in SHAPE_FIELDS:
        if new.config[key] != current.config[key]:
            raise InvalidRequest(f"model_path {path!r} is not the served model's shape: config.json {key} is "
                                 f"{shown(repr(new.config[key]))}, the served model's is "
                                 f"{shown(repr(current.config[key]))}")
    missing = sorted(set(current.tensors) - set(new.tensors))
    extra = sorted(set(new.tensors) - set(current.tensors))
    if missing or extra:
        raise InvalidRequest(f"model_path {path!r} does not hold the served model's tensors: "
                             f"missing {[shown(n) for n in missing[:5]]}, unexpected {[shown(n) for n in extra[:5]]}")
    for name, shape in current.tensors.items():
        if new.tensors[name] != shape:
            raise InvalidRequest(f"model_path {path!r}: tensor {shown(name)} has shape "
                                 f"{shown_shape(new.tensors[name])}, the served model's has {shown_shape(shape)}")

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

Everything read is bounded: the config and each header in size, the number of
shards, the JSON in depth.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handoff.service.errors import InvalidRequest
from handoff.service.peer_json import PeerJSONError, loads_bounded

MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_SHARDS = 4096
SHAPE_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointShape:
    """What must match for an in-place reload: the config's shape fields and each tensor's shape."""

    path: str
    config: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]


def read_checkpoint(path: str) -> CheckpointShape:
    """The shape of the checkpoint folder at ``path``; InvalidRequest saying what is missing or unreadable."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidRequest(f"model_path {path!r} is not a folder the node can read (the sidecar checks the "
                             "checkpoint on the engine's filesystem before the engine loads it)")
    config = _json_file(folder / "config.json", MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise InvalidRequest(f"{folder / 'config.json'} is not a JSON object")
    tensors: dict[str, tuple[int, ...]] = {}
    for shard in _shards(folder):
        tensors.update(_header_shapes(shard))
    return CheckpointShape(path, {k: config.get(k) for k in SHAPE_FIELDS}, tensors)


def check_compatible(new: CheckpointShape, current: CheckpointShape) -> None:
    """InvalidRequest naming the first difference between a checkpoint and the one being served."""
    for key in SHAPE_FIELDS:
        if new.config[key] != current.config[key]:
            raise InvalidRequest(f"model_path {new.path!r} is not the served model's shape: config.json {key} is "
                                 f"{new.config[key]!r}, the served model's is {current.config[key]!r}")
    missing = sorted(set(current.tensors) - set(new.tensors))
    extra = sorted(set(new.tensors) - set(current.tensors))
    if missing or extra:
        raise InvalidRequest(f"model_path {new.path!r} does not hold the served model's tensors: "
                             f"missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in current.tensors.items():
        if new.tensors[name] != shape:
            raise InvalidRequest(f"model_path {new.path!r}: tensor {name} has shape {list(new.tensors[name])}, "
                                 f"the served model's has {list(shape)}")


def _shards(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = _json_file(index, MAX_HEADER_BYTES)
        names = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(names, dict):
            raise InvalidRequest(f"{index} has no weight_map")
        files = sorted({str(name) for name in names.values()})
        if len(files) > MAX_SHARDS:
            raise InvalidRequest(f"{index} names {len(files)} shards, more than {MAX_SHARDS}")
        shards = [folder / name for name in files]
        outside = [s for s in shards if s.resolve().parent != folder.resolve()]
        if outside:
            raise InvalidRequest(f"{index} names files outside the checkpoint folder: {outside[:3]}")
        return shards
    shards = sorted(folder.glob("*.safetensors"))[:MAX_SHARDS + 1]
    if not shards:
        raise InvalidRequest(f"model_path {str(folder)!r} holds no *.safetensors file")
    if len(shards) > MAX_SHARDS:
        raise InvalidRequest(f"model_path {str(folder)!r} holds more than {MAX_SHARDS} safetensors files")
    return shards


def _header_shapes(shard: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape from a safetensors file's header (8-byte little-endian length, then JSON)."""
    try:
        with open(shard, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise InvalidRequest(f"{shard} is not a safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise InvalidRequest(f"{shard}: safetensors header of {length} bytes, more than {MAX_HEADER_BYTES}")
            header = loads_bounded(f.read(length), max_depth=8)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {shard}: {exc.strerror or exc}") from exc
    except PeerJSONError as exc:
        raise InvalidRequest(f"{shard}: the safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidRequest(f"{shard}: the safetensors header is not a JSON object")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
            raise InvalidRequest(f"{shard}: tensor {name!r} has no readable shape")
        shapes[name] = tuple(shape)
    return shapes


def _json_file(path: Path, max_bytes: int) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) > max_bytes:
        raise InvalidRequest(f"{path} is larger than {max_bytes} bytes")
    try:
        return loads_bounded(raw)
    except PeerJSONError as exc:
        raise InvalidRequest(f"{path} is not JSON: {exc}") from exc


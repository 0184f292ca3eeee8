"""SGLang's ``update_weights_from_tensor`` payload -> ``(name, tensor)`` pairs.

One base64 string per tensor-parallel rank (this engine is rank 0 of 1), each a
``MultiprocessingSerializer`` pickle (read with :mod:`.unpickler`) of one of:

- a list of ``(name, tensor)`` pairs, or of ``(name, LocalSerializedTensor)``
  whose ``values[rank]`` is that rank's tensor, pickled again (what SGLang's
  ``weight_sync.utils.update_weights``, used by verl, sends);
- with ``load_format: flattened_bucket``, ``{"flattened_tensor": uint8 tensor,
  "metadata": [FlattenedTensorMetadata, ...]}``: every tensor a view into one buffer.

Everything is checked as it is decoded: types, counts, each flattened entry's
byte range against the buffer, and the entries laid end to end over all of it.
Tensors stay where the sender put them (shared memory, or the device behind a
CUDA IPC handle); the engine copies from them.
"""

from __future__ import annotations

import base64
import binascii
import math
import threading
from typing import Any

import torch

from handoff.checkpoint.files import shown
from node_engine.weight_sync.unpickler import (FlattenedTensorMetadata, LocalSerializedTensor, PayloadBudget,
                                               UnsafePayload, restricted_loads)

MAX_TENSORS = 100_000
TP_RANK = 0


def decode_payload(serialized_named_tensors: list[str], load_format: str | None, *,
                   release_sender_reference: bool = True,
                   cancel: threading.Event | None = None) -> list[tuple[str, torch.Tensor]]:
    """This rank's ``(name, tensor)`` pairs; :class:`UnsafePayload` for anything else. ``cancel`` set (the
    caller's deadline passed) stops the decode soon, wherever it is."""
    budget = PayloadBudget(cancel)
    value = restricted_loads(_base64(serialized_named_tensors, TP_RANK), budget,
                             release_sender_reference=release_sender_reference)
    # SGLang decodes every rank's entry, each rank reading its own: one that is no payload is refused there too
    for index in range(len(serialized_named_tensors)):
        if index != TP_RANK:
            _base64(serialized_named_tensors, index)
    try:
        if load_format == "flattened_bucket":
            return _from_bucket(value)
        return _from_pairs(value, budget, release_sender_reference)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, RuntimeError, OverflowError) as exc:
        if isinstance(exc, UnsafePayload):
            raise
        # what the checks above did not foresee in a payload's values is still the payload's fault
        raise UnsafePayload(f"the payload holds something that is not a tensor payload: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from exc


def _base64(entries: list[str], index: int) -> bytes:
    try:
        return base64.b64decode(entries[index], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnsafePayload(f"serialized_named_tensors[{index}] is not base64: {exc}") from exc


def _from_pairs(value: Any, budget: PayloadBudget, release_sender_reference: bool) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TENSORS:
        raise UnsafePayload(f"the payload must be a list of (name, tensor) pairs (at most {MAX_TENSORS})")
    pairs = []
    decoded: dict[int, Any] = {}  # one decode per inner pickle, however often the payload refers to it
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise UnsafePayload("each entry of the payload must be a (name, tensor) pair")
        name, tensor = item
        if isinstance(tensor, LocalSerializedTensor):
            if len(tensor.values) <= TP_RANK:
                raise UnsafePayload(f"{shown(name)}: LocalSerializedTensor has no bytes for rank {TP_RANK}")
            inner = tensor.values[TP_RANK]
            if id(inner) not in decoded:
                decoded[id(inner)] = restricted_loads(inner, budget, release_sender_reference=release_sender_reference)
            tensor = decoded[id(inner)]
        if not isinstance(tensor, torch.Tensor):
            raise UnsafePayload(f"{shown(name)} is a {type(tensor).__name__}, not a tensor")
        pairs.append((name, tensor))
    return pairs


def _from_bucket(value: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(value, dict) or set(value) != {"flattened_tensor", "metadata"}:
        raise UnsafePayload("a flattened bucket must be {'flattened_tensor': tensor, 'metadata': [...]}")
    flat, metadata = value["flattened_tensor"], value["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise UnsafePayload("flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metadata, list) or not metadata or len(metadata) > MAX_TENSORS:
        raise UnsafePayload(f"metadata must list 1 to {MAX_TENSORS} entries")
    pairs = []
    for meta in metadata:  # each entry's fields were checked as it was built (FlattenedTensorMetadata)
        if not isinstance(meta, FlattenedTensorMetadata):
            raise UnsafePayload("metadata entries must be FlattenedTensorMetadata")
        num_bytes = meta.dtype.itemsize * math.prod(meta.shape)
        if (not 0 <= meta.start_idx <= meta.end_idx <= flat.numel() or meta.end_idx - meta.start_idx != num_bytes
                or meta.numel != num_bytes or meta.start_idx % meta.dtype.itemsize):
            raise UnsafePayload(f"{meta.name[:200]}: bytes [{meta.start_idx}, {meta.end_idx}) (numel {meta.numel}) "
                                f"do not hold a {meta.dtype} tensor of shape {list(meta.shape)} inside a buffer of "
                                f"{flat.numel()}")
        try:
            pairs.append((meta.name, flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)))
        except RuntimeError as exc:  # a view the buffer's alignment does not allow
            raise UnsafePayload(f"{meta.name[:200]}: {exc}") from exc
    _check_tiling(metadata, flat.numel())
    return pairs


def _check_tiling(metadata: list[FlattenedTensorMetadata], buffer_bytes: int) -> None:
    """SGLang's bucket lays its tensors end to end over the whole buffer: a gap, an overlap or bytes past the last
    entry mean the metadata is not the buffer's (entries lost or made up), and loading it would be a partial or
    garbled update."""
    end = 0
    for meta in sorted(metadata, key=lambda m: (m.start_idx, m.end_idx)):
        if meta.start_idx != end:
            what = "overlap" if meta.start_idx < end else "leave a gap"
            raise UnsafePayload(f"the bucket's metadata entries {what} at byte {min(end, meta.start_idx)} "
                                f"({meta.name[:200]}): they must lie end to end over the buffer")
        end = meta.end_idx
    if end != buffer_bytes:
        raise UnsafePayload(f"the bucket's metadata covers {end} bytes of a buffer of {buffer_bytes}: entries are "
                            "missing")

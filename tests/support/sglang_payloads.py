"""SGLang 0.5.23's ``update_weights_from_tensor`` payloads, as its serializer writes them.

SGLang's data classes are defined here under SGLang's module paths (registered
in ``sys.modules``), so a pickle of them names exactly the globals a real
payload names; ``serialize`` is ``MultiprocessingSerializer.serialize``
(``ForkingPickler``). verl's bucketed push (``sglang.srt.weight_sync.utils.update_weights``)
wraps each tensor in ``LocalSerializedTensor``; ``flattened_bucket`` packs a
bucket into one byte buffer with ``FlattenedTensorMetadata`` entries.
"""

from __future__ import annotations

import base64
import io
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

_RUNNER = "sglang.srt.model_executor.model_runner_components.weight_updater"
_BUCKET = "sglang.srt.weight_sync.tensor_bucket"


def _register(module_name: str, cls: type) -> None:
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        sys.modules.setdefault(name, types.ModuleType(name))
    cls.__module__ = module_name
    setattr(sys.modules[module_name], cls.__name__, cls)


@dataclass
class LocalSerializedTensor:
    values: list[bytes]


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_register(_RUNNER, LocalSerializedTensor)
_register(_BUCKET, FlattenedTensorMetadata)


def serialize(obj: object) -> bytes:
    mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def verl_payload(named: list[tuple[str, torch.Tensor]]) -> str:
    """What ``sglang.srt.weight_sync.utils.update_weights`` sends for one bucket at TP size 1."""
    return b64(serialize([(name, LocalSerializedTensor([serialize(t.detach())])) for name, t in named]))


def flattened_payload(named: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """A ``flattened_bucket`` payload (SGLang's ``FlattenedTensorBucket``), and the buffer to keep alive until
    the engine answered (its shared memory goes with it)."""
    metadata, parts, offset = [], [], 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + flat.numel(),
                                                flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    buffer = torch.cat(parts)
    return b64(serialize({"flattened_tensor": buffer, "metadata": metadata})), buffer

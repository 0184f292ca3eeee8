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
from torch.multiprocessing import reductions

_PATCH_TORCH = "sglang.srt.utils.patch_torch"
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


def _rebuild_cuda_tensor_modified(*args: object) -> torch.Tensor:
    """Named by SGLang's patched CUDA reduction; registered here only so that pickles name it."""
    raise NotImplementedError("only an engine rebuilds these")


_register(_RUNNER, LocalSerializedTensor)
_register(_BUCKET, FlattenedTensorMetadata)
_register(_PATCH_TORCH, _rebuild_cuda_tensor_modified)
_DEVICE_ARG = 6  # patch_torch's _REDUCE_TENSOR_ARG_DEVICE_INDEX


class _SGLangPickler(ForkingPickler):
    """``ForkingPickler`` after SGLang's ``monkey_patch_torch_reductions``: a CUDA tensor names
    ``_rebuild_cuda_tensor_modified`` and its device by UUID instead of by index."""

    def reducer_override(self, obj: object) -> object:
        if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
            return NotImplemented
        _, args = reductions.reduce_tensor(obj)
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        return _rebuild_cuda_tensor_modified, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])


def serialize(obj: object, *, patched_cuda: bool = False) -> bytes:
    """``MultiprocessingSerializer.serialize``; ``patched_cuda``: as SGLang's process pickles CUDA tensors (verl
    and slime import SGLang, so their pushes are patched)."""
    mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    (_SGLangPickler if patched_cuda else ForkingPickler)(buffer).dump(obj)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def verl_payload(named: list[tuple[str, torch.Tensor]], *, patched_cuda: bool = False) -> str:
    """What ``sglang.srt.weight_sync.utils.update_weights`` sends for one bucket at TP size 1."""
    return b64(serialize([(name, LocalSerializedTensor([serialize(t.detach(), patched_cuda=patched_cuda)]))
                          for name, t in named], patched_cuda=patched_cuda))


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """SGLang's ``FlattenedTensorBucket``: one byte buffer and a ``FlattenedTensorMetadata`` per tensor."""
    metadata, parts, offset = [], [], 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + flat.numel(),
                                                flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def flattened_payload(named: list[tuple[str, torch.Tensor]], *, patched_cuda: bool = False
                      ) -> tuple[str, torch.Tensor]:
    """A ``flattened_bucket`` payload, and the buffer to keep alive until the engine answered (its shared
    memory goes with it)."""
    bucket = flatten_bucket(named)
    return b64(serialize(bucket, patched_cuda=patched_cuda)), bucket["flattened_tensor"]

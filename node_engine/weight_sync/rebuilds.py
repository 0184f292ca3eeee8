"""What a tensor payload's pickle may build (:mod:`.unpickler`): checking stand-ins for torch's rebuilds, inert
markers for the classes it names, SGLang's two data classes, and the budget one payload may spend.

Every callable here checks its arguments before anything is mapped or allocated: a
tensor must lie inside its storage, a shared-memory storage must be torch's segment
by name and hold the bytes claimed, a CUDA IPC handle is admitted only on a CUDA
engine. The data classes check their fields however they are built (their
constructor, or ``__setstate__``). The tables at the end are all a payload can name.
"""

from __future__ import annotations

import collections
import math
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.multiprocessing.reductions as reductions

from handoff.protocol.weights import MAX_ELEMENTS

__all__ = ["ALLOWED_GLOBALS", "BUILDABLE", "REFUSED_CLASSES", "FlattenedTensorMetadata", "LocalSerializedTensor", "PayloadBudget",
           "STORAGE_FILENAME", "UnsafePayload", "VALUES", "SAFE_CALLS", "storage_filename_rebuild"]

SHM_DIR = "/dev/shm"
_SHM_HANDLE = re.compile(rb"^/torch_\d+_\d+_\d+$")
_MAX_MANAGER_PATH = 4096
_MAX_TENSOR_RANK = 16
MAX_OPCODES = 20_000_000  # a payload of the 100,000 tensors allowed takes about 6 million
MAX_SEGMENTS = 16_384     # shared-memory segments mapped per payload (a model has a few thousand tensors)
_CANCEL_CHECK_EVERY = 4096


class UnsafePayload(ValueError):
    """A payload that names something outside the allowed table, or whose tensors do not check out."""


class PayloadBudget:
    """What decoding one payload (its outer pickle and every inner one) may spend: pickle operations, mapped
    shared-memory segments, and time (``cancel`` is set when the caller's deadline passed)."""

    def __init__(self, cancel: threading.Event | None = None, *, max_opcodes: int = MAX_OPCODES,
                 max_segments: int = MAX_SEGMENTS) -> None:
        self.cancel = cancel
        self.max_opcodes = max_opcodes
        self.max_segments = max_segments
        self.num_opcodes = 0
        self.num_segments = 0
        self._next_cancel_check = _CANCEL_CHECK_EVERY

    def spend_opcode(self) -> None:
        self.num_opcodes += 1
        if self.num_opcodes >= self._next_cancel_check:
            self._next_cancel_check += _CANCEL_CHECK_EVERY
            if self.num_opcodes > self.max_opcodes:
                raise UnsafePayload(f"the payload takes more than {self.max_opcodes} pickle operations")
            if self.cancel is not None and self.cancel.is_set():
                raise UnsafePayload("decoding the payload was given up (past its deadline)")

    def spend_segment(self) -> None:
        self.num_segments += 1
        if self.num_segments > self.max_segments:
            raise UnsafePayload(f"the payload maps more than {self.max_segments} shared-memory segments")


def _int(value: object, what: str, limit: int = 1 << 62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise UnsafePayload(f"{what} must be an integer from 0 to {limit - 1}")
    return value


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > _MAX_TENSOR_RANK:
        raise UnsafePayload(f"{what} must be a tuple of at most {_MAX_TENSOR_RANK} integers")
    dims = tuple(_int(v, what, MAX_ELEMENTS) for v in value)
    if math.prod(dims) >= MAX_ELEMENTS:
        raise UnsafePayload(f"{what} holds {math.prod(dims)} elements, more than any tensor")
    return dims


def _dtype(value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in _DTYPES.values():
        raise UnsafePayload("a dtype argument is not one of the torch dtypes a payload may use")
    return value


@dataclass
class LocalSerializedTensor:
    """SGLang's per-rank tensor wrapper: ``values[i]`` is rank i's serialized tensor (bytes, never copied)."""

    values: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.values, list) or not all(type(v) is bytes for v in self.values):
            raise UnsafePayload("a LocalSerializedTensor must hold only a list of byte strings")

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or set(state) != {"values"}:
            raise UnsafePayload("a LocalSerializedTensor must hold only a list of byte strings")
        self.values = state["values"]
        self.__post_init__()


@dataclass
class FlattenedTensorMetadata:
    """SGLang's entry of a flattened bucket: a tensor's place in the flat byte buffer."""

    name: str = ""
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.uint8
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise UnsafePayload("a FlattenedTensorMetadata's name must be a string")
        self.shape = _shape(self.shape, f"{self.name[:200]}: shape")
        self.dtype = _dtype(self.dtype)
        for what in ("start_idx", "end_idx", "numel"):
            _int(getattr(self, what), f"{self.name[:200]}: {what}")

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or set(state) != {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}:
            raise UnsafePayload("a FlattenedTensorMetadata must hold exactly name, shape, dtype, start_idx, "
                                "end_idx and numel")
        self.__dict__.update(state)
        self.__post_init__()


class _Marker:
    """A class the pickle may name as an argument (``torch.Tensor``) but never call."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsafePayload(f"{self.name} may not be called by a payload")

    def __repr__(self) -> str:
        return f"<payload marker {self.name}>"


TENSOR = _Marker("torch.Tensor")
PARAMETER = _Marker("torch.nn.Parameter")
UNTYPED_STORAGE = _Marker("torch.UntypedStorage")
TYPED_STORAGE = _Marker("torch.TypedStorage")


def _rebuild_tensor(cls: object, storage: object, metadata: object) -> torch.Tensor:
    if cls not in (TENSOR, PARAMETER):
        raise UnsafePayload("a tensor must be rebuilt as torch.Tensor or torch.nn.Parameter")
    if not isinstance(storage, torch.TypedStorage):
        raise UnsafePayload("a tensor must be rebuilt on a storage")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise UnsafePayload("tensor metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride, _ = metadata
    offset, size, stride = _int(offset, "storage offset"), _shape(size, "size"), _shape(stride, "stride")
    if len(size) != len(stride):
        raise UnsafePayload("a tensor's size and stride differ in rank")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride) if n > 0) if all(size) else offset - 1
    num_elements = storage._size()  # size() warns that TypedStorage is deprecated: torch's own rebuilds use this
    if last >= num_elements:
        raise UnsafePayload(f"a tensor reaches element {last} of a storage of {num_elements}")
    return torch._utils._rebuild_tensor(storage, offset, size, stride)


def _rebuild_typed_storage(storage: object, dtype: object) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage):
        raise UnsafePayload("a typed storage must wrap an untyped storage")
    return reductions.rebuild_typed_storage(storage, _dtype(dtype))


def storage_filename_rebuild(budget: PayloadBudget,
                             release_sender_reference: bool) -> Callable[..., torch.UntypedStorage]:
    """torch's ``rebuild_storage_filename``, checked. torch counts one reader per serialization: the reader
    releases the reference the sender took for it. Without ``release_sender_reference`` this reader maps the
    segment without taking that reference (another reader of the same payload does), so several engines may
    read one payload and the segment still lives exactly as long as the sender keeps it."""

    def rebuild(cls: object, manager: object, handle: object, size: object,
                dtype: object = None) -> torch.UntypedStorage:
        if cls is not UNTYPED_STORAGE or dtype is not None:
            raise UnsafePayload("shared-memory storages must be untyped")
        if not isinstance(handle, bytes) or not _SHM_HANDLE.match(handle):
            raise UnsafePayload("a shared-memory name must be torch's (/torch_<pid>_<n>_<n>)")
        if (not isinstance(manager, bytes) or b"\0" in manager or len(manager) > _MAX_MANAGER_PATH
                or not manager.endswith(b"/manager.sock")):
            raise UnsafePayload("the shared-memory manager must be torch's manager socket")
        num_bytes = _int(size, "storage size")
        budget.spend_segment()
        try:
            segment = os.stat(os.path.join(SHM_DIR, handle.decode()[1:]))
            manager_mode = os.stat(manager).st_mode
        except OSError as exc:
            raise UnsafePayload(f"shared memory {handle.decode()} is not there (was the sender's tensor freed, or is "
                                f"the sender on another host?): {exc.strerror}") from exc
        if not stat.S_ISREG(segment.st_mode) or segment.st_size < num_bytes:
            raise UnsafePayload(f"shared memory {handle.decode()} holds {segment.st_size} bytes, {num_bytes} "
                                "claimed")
        if not stat.S_ISSOCK(manager_mode):
            raise UnsafePayload("the shared-memory manager path is not a socket")
        if release_sender_reference:
            return reductions.rebuild_storage_filename(torch.UntypedStorage, manager, handle, num_bytes)
        return torch.UntypedStorage._new_shared_filename_cpu(manager, handle, num_bytes)

    return rebuild


def _rebuild_storage_empty(cls: object) -> torch.UntypedStorage:
    if cls is not UNTYPED_STORAGE:
        raise UnsafePayload("an empty storage must be untyped")
    return torch.UntypedStorage()


_FD_SHARING = ("the sender shares tensors by file descriptor, which works only between a process and its "
               "children; call torch.multiprocessing.set_sharing_strategy('file_system') in the sender")


def _refuse_fd_storage(*args: object) -> None:
    raise UnsafePayload(_FD_SHARING)


class _RefusedDupFd:
    """``multiprocessing.resource_sharer.DupFd`` (rebuilt with NEWOBJ): it would connect to an address in the payload."""

    def __new__(cls, *args: object) -> "_RefusedDupFd":
        raise UnsafePayload(_FD_SHARING)


def _cuda_device(value: object) -> int:
    """SGLang sends a device's UUID (its patched reduction) or torch's index."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < torch.cuda.device_count():
        return value
    if isinstance(value, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == value:
                return index
    raise UnsafePayload(f"no CUDA device {value!r} on this host (CUDA IPC handles are valid only on their host)")


def _rebuild_cuda_tensor(tensor_cls: object, tensor_size: object, tensor_stride: object, tensor_offset: object,
                         storage_cls: object, dtype: object, storage_device: object, *rest: object) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise UnsafePayload("a CUDA IPC handle was sent to an engine without CUDA")
    if tensor_cls not in (TENSOR, PARAMETER) or storage_cls not in (UNTYPED_STORAGE, TYPED_STORAGE):
        raise UnsafePayload("a CUDA tensor must be rebuilt as a tensor on a storage")
    if len(rest) != 8:
        raise UnsafePayload("a CUDA tensor needs torch's 15 rebuild arguments")
    size, stride = _shape(tensor_size, "size"), _shape(tensor_stride, "stride")
    offset = _int(tensor_offset, "storage offset")
    handle, size_bytes, offset_bytes = rest[0], _int(rest[1], "storage bytes"), _int(rest[2], "storage offset")
    if handle is not None and not isinstance(handle, bytes):
        raise UnsafePayload("a CUDA IPC handle must be bytes")
    itemsize = _dtype(dtype).itemsize
    last = offset + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if all(size) and (last + 1) * itemsize > size_bytes:
        raise UnsafePayload("a CUDA tensor reaches past its storage")
    real_storage_cls = torch.UntypedStorage if storage_cls is UNTYPED_STORAGE else torch.TypedStorage
    return reductions.rebuild_cuda_tensor(torch.Tensor, size, stride, offset, real_storage_cls, dtype,
                                          _cuda_device(storage_device), handle, size_bytes, offset_bytes, *rest[3:])


def _ordered_dict() -> collections.OrderedDict[str, Any]:
    """An empty OrderedDict, as pickle rebuilds one before its items (string keys only) are set."""
    return collections.OrderedDict()


_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}

SAFE_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _refuse_fd_storage,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): _ordered_dict,
}
VALUES: dict[tuple[str, str], object] = {
    ("torch", "Tensor"): TENSOR,
    ("torch.nn.parameter", "Parameter"): PARAMETER,
    ("torch.storage", "UntypedStorage"): UNTYPED_STORAGE,
    ("torch", "UntypedStorage"): UNTYPED_STORAGE,
    ("torch.storage", "TypedStorage"): TYPED_STORAGE,
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("multiprocessing.resource_sharer", "DupFd"): _RefusedDupFd,
}
STORAGE_FILENAME = ("torch.multiprocessing.reductions", "rebuild_storage_filename")
ALLOWED_GLOBALS = frozenset(SAFE_CALLS) | frozenset(VALUES) | {STORAGE_FILENAME}
# the only objects whose state a payload may set (pickle's BUILD): their __setstate__ checks it
BUILDABLE = (LocalSerializedTensor, FlattenedTensorMetadata)
# classes a payload may name for NEWOBJ only to be told why not
REFUSED_CLASSES = (_RefusedDupFd,)

"""A restricted unpickler for SGLang's tensor payloads: torch's tensor and storage rebuilds, plain containers,
and nothing else.

``update_weights_from_tensor`` carries ``MultiprocessingSerializer`` output: a
pickle made by torch's ``ForkingPickler``, in which tensors are references to
shared memory (CPU) or CUDA IPC handles. Unpickling runs any callable a pickle
names, so a payload from the network is never unpickled as it is. Here:

- :meth:`RestrictedUnpickler.find_class` knows a fixed table of globals. Each
  maps to a *checking* stand-in, never to the callable the pickle names when
  that callable could be abused: tensor and storage classes are inert markers,
  and the rebuild functions check their arguments before calling torch's.
  Anything else (``os.system``, ``builtins.open``, ``functools.partial``, a
  resource sharer that would connect to an address in the payload) is
  :class:`UnsafePayload` and nothing runs.
- A CPU storage must be torch's shared memory by name (the ``file_system``
  sharing strategy): the name must look like torch's, the segment must exist
  and hold at least the bytes claimed (a shorter one would crash the engine on
  first touch), and the manager socket must be a socket. Storages passed by file
  descriptor (torch's default strategy) are refused with what to change.
  torch counts one reader per serialization; when one payload goes to several
  engines, all but one read it without releasing the sender's reference
  (``release_sender_reference``), so the segment is never unlinked early.
- CUDA IPC handles are admitted only on a CUDA engine.
- Container opcodes (lists, tuples, dicts) need no globals; ``collections.OrderedDict``,
  ``torch.Size``, ``torch.device`` and torch dtypes are the only other values.
  SGLang's own data classes (``LocalSerializedTensor``, ``FlattenedTensorMetadata``)
  load into local look-alikes that accept only their fields.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.multiprocessing.reductions as reductions

SHM_DIR = "/dev/shm"
_SHM_HANDLE = re.compile(rb"^/torch_\d+_\d+_\d+$")
_MAX_MANAGER_PATH = 4096
_MAX_TENSOR_RANK = 16


class UnsafePayload(ValueError):
    """A payload that names something outside the allowed table, or whose tensors do not check out."""


@dataclass
class LocalSerializedTensor:
    """SGLang's per-rank tensor wrapper: ``values[i]`` is rank i's serialized tensor."""

    values: list[bytes] = field(default_factory=list)

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or set(state) != {"values"} or not isinstance(state["values"], list) or not all(
                isinstance(v, (bytes, bytearray)) for v in state["values"]):
            raise UnsafePayload("a LocalSerializedTensor must hold only a list of byte strings")
        self.values = [bytes(v) for v in state["values"]]


@dataclass
class FlattenedTensorMetadata:
    """SGLang's entry of a flattened bucket: a tensor's place in the flat byte buffer."""

    name: str = ""
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.uint8
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0

    def __setstate__(self, state: object) -> None:
        fields = {"name": str, "shape": tuple, "dtype": torch.dtype, "start_idx": int, "end_idx": int, "numel": int}
        if not isinstance(state, dict) or set(state) != set(fields) or not all(
                isinstance(state[k], t) for k, t in fields.items()):
            raise UnsafePayload("a FlattenedTensorMetadata must hold exactly name, shape, dtype, start_idx, "
                                "end_idx and numel")
        self.__dict__.update(state)


class _Marker:
    """A class the pickle may name as an argument (``torch.Tensor``) but never call."""

    def __init__(self, name: str, real: type) -> None:
        self.name = name
        self.real = real

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsafePayload(f"{self.name} may not be called by a payload")

    def __repr__(self) -> str:
        return f"<payload marker {self.name}>"


TENSOR = _Marker("torch.Tensor", torch.Tensor)
PARAMETER = _Marker("torch.nn.Parameter", torch.nn.Parameter)
UNTYPED_STORAGE = _Marker("torch.UntypedStorage", torch.UntypedStorage)
TYPED_STORAGE = _Marker("torch.TypedStorage", torch.TypedStorage)


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UnsafePayload(f"{what} must be a non-negative integer")
    return value


def _shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > _MAX_TENSOR_RANK:
        raise UnsafePayload(f"{what} must be a tuple of at most {_MAX_TENSOR_RANK} integers")
    return tuple(_int(v, what) for v in value)


def _dtype(value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise UnsafePayload("a dtype argument is not a torch dtype")
    return value


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
    if last >= storage.size():
        raise UnsafePayload(f"a tensor reaches element {last} of a storage of {storage.size()}")
    return torch._utils._rebuild_tensor(storage, offset, size, stride)


def _rebuild_typed_storage(storage: object, dtype: object) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage):
        raise UnsafePayload("a typed storage must wrap an untyped storage")
    return reductions.rebuild_typed_storage(storage, _dtype(dtype))


def _storage_filename_rebuild(release_sender_reference: bool) -> Callable[..., torch.UntypedStorage]:
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
    return reductions.rebuild_cuda_tensor(torch.Tensor, size, stride, offset, storage_cls.real, dtype,  # type: ignore[union-attr]
                                          _cuda_device(storage_device), handle, size_bytes, offset_bytes, *rest[3:])


_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}

_SAFE_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _refuse_fd_storage,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
_VALUES: dict[tuple[str, str], object] = {
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
ALLOWED_GLOBALS = frozenset(_SAFE_CALLS) | frozenset(_VALUES) | {("torch.multiprocessing.reductions",
                                                                  "rebuild_storage_filename")}


_STORAGE_FILENAME = ("torch.multiprocessing.reductions", "rebuild_storage_filename")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only what :data:`ALLOWED_GLOBALS` names (see the module docstring)."""

    def __init__(self, file: io.BytesIO, *, release_sender_reference: bool = True) -> None:
        super().__init__(file)
        self._storage_filename = _storage_filename_rebuild(release_sender_reference)

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == _STORAGE_FILENAME:
            return self._storage_filename
        if key in _SAFE_CALLS:
            return _SAFE_CALLS[key]
        if key in _VALUES:
            return _VALUES[key]
        raise UnsafePayload(f"the payload names {module}.{name}, which is not a tensor, a storage or a plain "
                            "container; nothing was run")

    def persistent_load(self, pid: object) -> Any:
        raise UnsafePayload("the payload uses persistent ids; nothing was run")


def restricted_loads(data: bytes, *, release_sender_reference: bool = True) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`; every failure is an :class:`UnsafePayload`."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), release_sender_reference=release_sender_reference).load()
    except UnsafePayload:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RuntimeError, MemoryError, OverflowError, RecursionError) as exc:
        raise UnsafePayload(f"the payload cannot be unpickled: {type(exc).__name__}: {exc}") from exc

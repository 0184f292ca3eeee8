"""Checking stand-ins for torch's tensor and storage rebuilds, the only ones a tensor payload's pickle may call
(:mod:`.rebuilds` tables them), and the inert markers of the torch classes it may name as their arguments.

Each checks its arguments before anything is mapped or allocated: a tensor must lie inside its storage, a
shared-memory storage must be torch's segment by name, a regular file, and hold torch's header and the bytes claimed,
a CUDA IPC handle is admitted only on a CUDA engine; storages shared by file descriptor are refused with the reason.

A shared-memory storage is registered with this engine's own torch shared-memory manager, never with the socket the
payload names: torch connects to that socket holding the GIL and without a timeout, so a socket that never accepts
would stop the whole engine. (The manager only unlinks, when every process using it is gone, the segments still in
use: the sender's manager still does that for the sender's; the engine's, for those it maps when it dies.)
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any, Callable

import torch
import torch.multiprocessing.reductions as reductions

from node_engine.weight_sync.payload_checks import PayloadBudget, UnsafePayload, check_dtype, check_int, check_shape

SHM_DIR = "/dev/shm"
_SHM_HANDLE = re.compile(rb"^/torch_\d+_\d+_\d+$")
_MAX_MANAGER_PATH = 4096
_SEGMENT_HEADER = 64  # torch's refcount, before a segment's data (c10's alignment): torch maps the bytes claimed + it
_OWN_MANAGER = b""  # libshm: this process's own manager (started on first use), not the payload's


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


def rebuild_tensor(cls: object, storage: object, metadata: object) -> torch.Tensor:
    if cls not in (TENSOR, PARAMETER):
        raise UnsafePayload("a tensor must be rebuilt as torch.Tensor or torch.nn.Parameter")
    if not isinstance(storage, torch.TypedStorage):
        raise UnsafePayload("a tensor must be rebuilt on a storage")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise UnsafePayload("tensor metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride, _ = metadata
    offset, size, stride = check_int(offset, "storage offset"), check_shape(size, "size"), check_shape(stride, "stride")
    if len(size) != len(stride):
        raise UnsafePayload("a tensor's size and stride differ in rank")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride) if n > 0) if all(size) else offset - 1
    num_elements = storage._size()  # size() warns that TypedStorage is deprecated: torch's own rebuilds use this
    if last >= num_elements:
        raise UnsafePayload(f"a tensor reaches element {last} of a storage of {num_elements}")
    return torch._utils._rebuild_tensor(storage, offset, size, stride)


def rebuild_typed_storage(storage: object, dtype: object) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage):
        raise UnsafePayload("a typed storage must wrap an untyped storage")
    return reductions.rebuild_typed_storage(storage, check_dtype(dtype))


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
        num_bytes = check_int(size, "storage size")
        budget.spend_segment()
        try:
            segment = os.lstat(os.path.join(SHM_DIR, handle.decode()[1:]))
        except OSError as exc:
            raise UnsafePayload(f"shared memory {handle.decode()} is not there (was the sender's tensor freed, or is "
                                f"the sender on another host?): {exc.strerror}") from exc
        if not stat.S_ISREG(segment.st_mode):
            raise UnsafePayload(f"shared memory {handle.decode()} is not a regular file")
        if segment.st_size < num_bytes + _SEGMENT_HEADER:  # torch would grow the file to its header + the bytes
            raise UnsafePayload(f"shared memory {handle.decode()} holds {segment.st_size} bytes, not torch's "
                                f"{_SEGMENT_HEADER}-byte header and the {num_bytes} claimed")
        if release_sender_reference:
            return reductions.rebuild_storage_filename(torch.UntypedStorage, _OWN_MANAGER, handle, num_bytes)
        return torch.UntypedStorage._new_shared_filename_cpu(_OWN_MANAGER, handle, num_bytes)

    return rebuild


def rebuild_storage_empty(cls: object) -> torch.UntypedStorage:
    if cls is not UNTYPED_STORAGE:
        raise UnsafePayload("an empty storage must be untyped")
    return torch.UntypedStorage()


_FD_SHARING = ("the sender shares tensors by file descriptor, which works only between a process and its "
               "children; call torch.multiprocessing.set_sharing_strategy('file_system') in the sender")


def refuse_fd_storage(*args: object) -> None:
    raise UnsafePayload(_FD_SHARING)


class RefusedDupFd:
    """``multiprocessing.resource_sharer.DupFd`` (rebuilt with NEWOBJ): it would connect to an address in the
    payload."""

    def __new__(cls, *args: object) -> "RefusedDupFd":
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


def rebuild_cuda_tensor(tensor_cls: object, tensor_size: object, tensor_stride: object, tensor_offset: object,
                         storage_cls: object, dtype: object, storage_device: object, *rest: object) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise UnsafePayload("a CUDA IPC handle was sent to an engine without CUDA")
    if tensor_cls not in (TENSOR, PARAMETER) or storage_cls not in (UNTYPED_STORAGE, TYPED_STORAGE):
        raise UnsafePayload("a CUDA tensor must be rebuilt as a tensor on a storage")
    if len(rest) != 8:
        raise UnsafePayload("a CUDA tensor needs torch's 15 rebuild arguments")
    size, stride = check_shape(tensor_size, "size"), check_shape(tensor_stride, "stride")
    offset = check_int(tensor_offset, "storage offset")
    handle = rest[0]
    size_bytes, offset_bytes = check_int(rest[1], "storage bytes"), check_int(rest[2], "storage offset")
    if handle is not None and not isinstance(handle, bytes):
        raise UnsafePayload("a CUDA IPC handle must be bytes")
    itemsize = check_dtype(dtype).itemsize
    last = offset + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
    if all(size) and (last + 1) * itemsize > size_bytes:
        raise UnsafePayload("a CUDA tensor reaches past its storage")
    real_storage_cls = torch.UntypedStorage if storage_cls is UNTYPED_STORAGE else torch.TypedStorage
    return reductions.rebuild_cuda_tensor(torch.Tensor, size, stride, offset, real_storage_cls, dtype,
                                          _cuda_device(storage_device), handle, size_bytes, offset_bytes, *rest[3:])

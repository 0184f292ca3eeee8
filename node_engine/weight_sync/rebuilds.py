"""What a tensor payload's pickle may build (:mod:`.unpickler`): the tables of everything it can name, and SGLang's
two data classes.

The torch rebuilds it may call and the markers of the classes it may name are :mod:`.tensor_rebuilds`'s; the checks
of its values and the budget one payload may spend are :mod:`.payload_checks`'s. The data classes check their fields
however they are built (their constructor, or ``__setstate__``). The tables at the end are all a payload can name.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from node_engine.weight_sync.payload_checks import DTYPES, UnsafePayload, check_dtype, check_int, check_shape
from node_engine.weight_sync.tensor_rebuilds import (PARAMETER, TENSOR, TYPED_STORAGE, UNTYPED_STORAGE, RefusedDupFd,
                                                     rebuild_cuda_tensor, rebuild_storage_empty, rebuild_tensor,
                                                     rebuild_typed_storage, refuse_fd_storage)

__all__ = ["ALLOWED_GLOBALS", "BUILDABLE", "REFUSED_CLASSES", "FlattenedTensorMetadata", "LocalSerializedTensor",
           "STORAGE_FILENAME", "VALUES", "SAFE_CALLS"]


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
        self.shape = check_shape(self.shape, f"{self.name[:200]}: shape")
        self.dtype = check_dtype(self.dtype)
        for what in ("start_idx", "end_idx", "numel"):
            check_int(getattr(self, what), f"{self.name[:200]}: {what}")

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict) or set(state) != {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}:
            raise UnsafePayload("a FlattenedTensorMetadata must hold exactly name, shape, dtype, start_idx, "
                                "end_idx and numel")
        self.__dict__.update(state)
        self.__post_init__()


def _ordered_dict() -> collections.OrderedDict[str, Any]:
    """An empty OrderedDict, as pickle rebuilds one before its items (string keys only) are set."""
    return collections.OrderedDict()


# NeMo-RL pushes ``flattened_bucket`` payloads built with its own copies of SGLang's bucket class and CUDA patch
# (``nemo_rl/models/generation/sglang/utils/train_utils.py``): the same data, named after its module
NEMO_RL_TRAIN_UTILS = "nemo_rl.models.generation.sglang.utils.train_utils"
SAFE_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): refuse_fd_storage,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor,
    (NEMO_RL_TRAIN_UTILS, "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor,  # its copy of the patch
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
    **{("torch", name): dtype for name, dtype in DTYPES.items()},
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    (NEMO_RL_TRAIN_UTILS, "FlattenedTensorMetadata"): FlattenedTensorMetadata,  # its copy of the class
    ("multiprocessing.resource_sharer", "DupFd"): RefusedDupFd,
}
STORAGE_FILENAME = ("torch.multiprocessing.reductions", "rebuild_storage_filename")
ALLOWED_GLOBALS = frozenset(SAFE_CALLS) | frozenset(VALUES) | {STORAGE_FILENAME}
# the only objects whose state a payload may set (pickle's BUILD): their __setstate__ checks it
BUILDABLE = (LocalSerializedTensor, FlattenedTensorMetadata)
# classes a payload may name for NEWOBJ only to be told why not
REFUSED_CLASSES = (RefusedDupFd,)

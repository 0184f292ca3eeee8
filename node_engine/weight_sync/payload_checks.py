"""The checks every value a tensor payload's pickle passes goes through (:mod:`.unpickler`): the budget one payload
may spend (pickle operations, shared-memory segments, the caller's deadline), integers, shapes and dtypes in range,
and :class:`UnsafePayload`, the one error a payload that fails them raises."""

from __future__ import annotations

import math
import threading

import torch

from handoff.protocol.weights import MAX_ELEMENTS

_MAX_TENSOR_RANK = 16
MAX_OPCODES = 20_000_000  # a payload of the 100,000 tensors allowed takes about 6 million
MAX_SEGMENTS = 16_384     # shared-memory segments mapped per payload (a model has a few thousand tensors)
_CANCEL_CHECK_EVERY = 4096
# the torch dtypes a payload may use, by their name in the ``torch`` module
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


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



def check_int(value: object, what: str, limit: int = 1 << 62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise UnsafePayload(f"{what} must be an integer from 0 to {limit - 1}")
    return value


def check_shape(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > _MAX_TENSOR_RANK:
        raise UnsafePayload(f"{what} must be a tuple of at most {_MAX_TENSOR_RANK} integers")
    dims = tuple(check_int(v, what, MAX_ELEMENTS) for v in value)
    if math.prod(dims) >= MAX_ELEMENTS:
        raise UnsafePayload(f"{what} holds {math.prod(dims)} elements, more than any tensor")
    return dims


def check_dtype(value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in DTYPES.values():
        raise UnsafePayload("a dtype argument is not one of the torch dtypes a payload may use")
    return value

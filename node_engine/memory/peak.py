"""Measuring a peak: how much memory a piece of work took at its highest.

- CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``)
  since a reset, and free memory from the driver.
- CPU: the process's peak resident set (``VmHWM``), reset by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux 4.0+). The heap is trimmed first, so freed
  pages that malloc still held do not hide new allocations. RSS stands in for
  an allocator's peak: it counts every byte the process touches, tensors or not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import torch

from node_engine.memory.host_heap import trim_host_heap

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class PeakUnavailable(RuntimeError):
    """This system cannot measure a peak (no ``/proc/self/clear_refs``)."""


class PeakMeter(Protocol):
    def reset(self) -> None:
        """Start a new window: :meth:`peak_bytes` reports the highest use from now on."""

    def current_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise PeakUnavailable(f"{_STATUS} has no {field}")
    return int(match.group(1)) * 1024


class HostPeakMeter:
    """The engine process's resident memory (CPU engines)."""

    def reset(self) -> None:
        trim_host_heap()
        try:
            _CLEAR_REFS.write_text("5")
        except OSError as exc:
            raise PeakUnavailable(f"cannot reset the peak resident set through {_CLEAR_REFS}: {exc}") from exc

    def current_bytes(self) -> int:
        return _status_kib("VmRSS")

    def peak_bytes(self) -> int:
        return max(_status_kib("VmHWM"), self.current_bytes())


class CudaPeakMeter:
    """Tensor memory of the current CUDA device, as torch's caching allocator counts it."""

    def reset(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def current_bytes(self) -> int:
        return torch.cuda.memory_allocated()

    def peak_bytes(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

"""The vision tower's worst case, measured at start and held in the ``workspace`` tag.

At start the engine encodes the worst-case image batch its caps allow
(``runtime.py``) and measures the peak. That many bytes stay reserved:

- CPU: a buffer of the measured peak, registered in ``workspace``. Each
  vision step borrows it: its pages go back to the OS right before the tower
  runs and are taken (touched) again right after, so the process never holds
  the reservation and the tower's working memory at once. glibc's mmap
  threshold is pinned first (``host_heap.pin_mmap_threshold``): otherwise
  freeing the reservation raises it, the tower's blocks then come from the
  arenas, and what the tower frees stays resident until the step ends, so
  the step's resident peak would exceed what was measured;
- CUDA: a private memory pool that the worst-case encode grew (inside the
  ``workspace`` region of torch_memory_saver); every later encode allocates
  from it, and nothing else can. (Should an encode ever need more, for
  fragmentation, the pool grows outside the region: that growth is not
  released with the tag.)

A release of ``workspace`` frees the reservation with the rest of the tag; a
resume restores it. ``--vision-reserve-mb`` replaces the measurement for
models whose worst case cannot be built at start.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

import torch

from node_engine.memory.host_heap import pin_mmap_threshold, trim_host_heap
from node_engine.memory.peak import CudaPeakMeter, HostPeakMeter, PeakMeter
from node_engine.memory.saver import MemorySaver
from node_engine.memory.tags import MemoryTag

log = logging.getLogger(__name__)

PAGE = 4096


class VisionReservation:
    """Bytes held for the vision tower; :meth:`lend` gives them to one encode."""

    def __init__(self, saver: MemorySaver, device: torch.device) -> None:
        self.saver = saver
        self.device = device
        self.num_bytes = 0
        self.measured_peak_bytes: int | None = None
        self._buffer: torch.Tensor | None = None
        self._pool = torch.cuda.MemPool() if device.type == "cuda" else None

    @classmethod
    def measured(cls, saver: MemorySaver, device: torch.device, encode_worst_case: Callable[[], None],
                 meter: PeakMeter | None = None) -> "VisionReservation":
        """Run ``encode_worst_case`` once and reserve its peak."""
        reservation = cls(saver, device)
        if reservation._pool is not None:
            reservation._measure_cuda(encode_worst_case)
        else:
            pin_mmap_threshold()
            meter = meter or HostPeakMeter()
            meter.reset()
            before = meter.current_bytes()
            encode_worst_case()
            reservation.measured_peak_bytes = max(0, meter.peak_bytes() - before)
            reservation._hold_host(reservation.measured_peak_bytes)
        return reservation

    @classmethod
    def fixed(cls, saver: MemorySaver, device: torch.device, num_bytes: int) -> "VisionReservation":
        """``--vision-reserve-mb``: reserve ``num_bytes`` without measuring."""
        reservation = cls(saver, device)
        if reservation._pool is not None:
            with saver.region(MemoryTag.WORKSPACE), torch.cuda.use_mem_pool(reservation._pool):
                torch.empty(num_bytes, dtype=torch.uint8, device=device)  # grows the pool; the pool keeps it
            reservation._account_pool()
        else:
            pin_mmap_threshold()
            reservation._hold_host(num_bytes)
        return reservation

    def _hold_host(self, num_bytes: int) -> None:
        self.num_bytes = -(-num_bytes // PAGE) * PAGE
        if self.num_bytes == 0:
            return
        with self.saver.region(MemoryTag.WORKSPACE):
            self._buffer = torch.zeros(self.num_bytes, dtype=torch.uint8, device=self.device)
        self.saver.register(MemoryTag.WORKSPACE, [self._buffer])

    def _measure_cuda(self, encode_worst_case: Callable[[], None]) -> None:
        meter = CudaPeakMeter()
        meter.reset()
        before = meter.current_bytes()
        with self.saver.region(MemoryTag.WORKSPACE), torch.cuda.use_mem_pool(self._pool):
            encode_worst_case()
        self.measured_peak_bytes = max(0, meter.peak_bytes() - before)
        self._account_pool()

    def _account_pool(self) -> None:
        torch.cuda.synchronize()
        self.num_bytes = sum(segment["total_size"] for segment in self._pool.snapshot())
        self.saver.add_bytes(MemoryTag.WORKSPACE, self.num_bytes)

    @contextlib.contextmanager
    def lend(self) -> Iterator[None]:
        """Around one vision encode: the reserved bytes are the encode's to use."""
        if self._pool is not None:
            with torch.cuda.use_mem_pool(self._pool):
                yield
            return
        buffer = self._buffer
        if buffer is None:
            yield
            return
        storage = buffer.untyped_storage()
        if storage.nbytes() == 0:  # released with the workspace: there is nothing to lend
            yield
            return
        storage.resize_(0)
        try:
            yield
        finally:
            trim_host_heap()  # what the encode freed goes back to the OS before the reservation is taken again
            storage.resize_(self.num_bytes)
            buffer[::PAGE].zero_()  # take the pages again (one write per page)

"""Where the free-memory figure for the resume check comes from (injectable for tests)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from node_engine.memory.cgroup_memory import host_memory

log = logging.getLogger(__name__)

_MAX_OVERRIDE_BYTES = 64  # a count of bytes is a few digits: a larger file is not one


@dataclass(frozen=True)
class DeviceMemory:
    device_type: str
    free_bytes: int
    total_bytes: int


class MemoryInfo(Protocol):
    def read(self) -> DeviceMemory: ...


class HostMemoryInfo:
    """CPU: ``MemAvailable`` and total RAM, within the container's memory limit."""

    def read(self) -> DeviceMemory:
        memory = host_memory()
        return DeviceMemory("cpu", memory.available_bytes, memory.total_bytes)


class CudaMemoryInfo:
    def read(self) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info()
        return DeviceMemory("cuda", int(free), int(total))


class FileOverrideMemoryInfo:
    """Reads the free bytes from a file when it holds a number, else defers to ``inner``.

    A testing and fault-drill hook (``--free-memory-override-file``): write a
    small number to the file and the next resume sees too little memory.
    """

    def __init__(self, path: Path, inner: MemoryInfo) -> None:
        self._path = path
        self._inner = inner

    def read(self) -> DeviceMemory:
        """The figure from the file; anything else than a count of bytes there (not text, a folder, a negative
        number) is ignored with a warning: every view and resume check reads this."""
        real = self._inner.read()
        try:
            with open(self._path, "rb") as f:
                raw = f.read(_MAX_OVERRIDE_BYTES)
        except FileNotFoundError:
            return real
        except OSError as exc:
            log.warning("ignoring %s: %s", self._path, exc)
            return real
        text = raw.decode("utf-8", errors="replace").strip()
        try:
            free_bytes = int(text)
        except ValueError:
            free_bytes = -1
        if free_bytes < 0:
            if text:
                log.warning("ignoring %s: %r is not a number of bytes", self._path, text[:40])
            return real
        return DeviceMemory(real.device_type, free_bytes, real.total_bytes)

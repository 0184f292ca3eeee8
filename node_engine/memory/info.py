"""Where the free-memory figure for the resume check comes from (injectable for tests)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from node_engine.memory.cgroup_memory import host_memory

log = logging.getLogger(__name__)

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
        real = self._inner.read()
        try:
            text = self._path.read_text().strip()
        except FileNotFoundError:
            return real
        try:
            free_bytes = int(text)
        except ValueError:
            if text:
                log.warning("ignoring %s: %r is not a number of bytes", self._path, text[:40])
            return real
        return DeviceMemory(real.device_type, free_bytes, real.total_bytes)

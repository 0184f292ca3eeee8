"""CUDA backend: torch_memory_saver (>= 0.0.10) in preload hook mode.

Regions are torch_memory_saver regions with the same tag names, so pausing a
tag unmaps its physical pages while keeping the virtual addresses: tensors and
captured CUDA graphs stay valid. The weights region is created with the CPU or
disk backup the engine was started with. Importing this module requires the
preload library in ``LD_PRELOAD``; ``node_engine.launch`` arranges that.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from node_engine.memory.saver import MemorySaver
from node_engine.memory.tags import BackupMode, MemoryTag


class CudaSaver(MemorySaver):
    name = "cuda"

    def __init__(self, weights_backup: BackupMode, backup_dir: Path) -> None:
        super().__init__()
        from torch_memory_saver import torch_memory_saver

        self._tms = torch_memory_saver
        self._weights_backup = weights_backup
        if weights_backup is BackupMode.DISK:
            self._tms.set_disk_backup_dir(str(backup_dir))

    @contextlib.contextmanager
    def region(self, tag: MemoryTag) -> Iterator[None]:
        is_weights = tag is MemoryTag.WEIGHTS
        with self._tms.region(tag=tag.value,
                              enable_cpu_backup=is_weights and self._weights_backup is BackupMode.CPU,
                              enable_disk_backup=is_weights and self._weights_backup is BackupMode.DISK):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
        """Capture ``graph`` so that its private memory pool belongs to the ``cuda_graph`` tag."""
        with self._tms.cuda_graph(graph, pool=pool, stream=stream, tag=MemoryTag.CUDA_GRAPH.value):
            yield

    def release(self, tag: MemoryTag, *, keep_contents: bool) -> int:
        # keep_contents is decided when the region was made (the backup mode); nothing to do per call.
        torch.cuda.synchronize()
        self._tms.pause(tag.value)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
        return self.tag_bytes(tag)

    def resume(self, tag: MemoryTag) -> int:
        self._tms.resume(tag.value)
        torch.cuda.synchronize()
        return self.tag_bytes(tag)

    def has_backup(self, tag: MemoryTag) -> bool:
        return tag is MemoryTag.WEIGHTS and self._weights_backup is not BackupMode.NONE

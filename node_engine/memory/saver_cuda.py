"""CUDA backend: torch_memory_saver (0.0.10) in preload hook mode.

Regions are torch_memory_saver regions with the same tag names, so pausing a
tag unmaps its physical pages while keeping the virtual addresses: tensors and
captured CUDA graphs stay valid. The weights region is created with the CPU or
disk backup the engine was started with. Importing this module requires the
preload library in ``LD_PRELOAD``; ``node_engine.launch`` arranges that.

What each tag holds is measured, not computed from tensor sizes: the segments
of torch's allocator in the memory pools the tag's regions (and the graph
captures) filled, which is what torch_memory_saver maps for it and a release
unmaps (allocation granularity and allocator segments included). Read from
the allocator each time, so a pool that grew for a probe and kept the block, or
let it go, is counted as it is now.

torch_memory_saver ends the process (``exit(1)``) where it cannot go on: no
device memory for a resume, a failed ``cudaMallocHost`` for the CPU backup, a
failed write or read of the disk backup. :meth:`CudaSaver.check_release` checks
what can be checked before a release; the resume check (free device memory) is
the memory manager's. The pinned CPU backup is kept across cycles
(``retain_cpu_backup``): allocated on the first release, reused after, never
more than the weights' bytes.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch

from node_engine.memory.backup_folder import BackupFolder
from node_engine.memory.backup_room import BackupUnavailable, check_dir_room, check_host_room
from node_engine.memory.saver import MemorySaver
from node_engine.memory.tags import BackupMode, MemoryTag

log = logging.getLogger(__name__)

_DEFAULT_POOL = (0, 0)  # torch's own pool: never a tag's, whatever a region block let slip into it
DISK_STAGING_BYTES = 256 * 1024 * 1024  # torch_memory_saver's pinned disk staging buffer (TMS_DISK_BACKUP_CHUNK_MB)


class CudaSaver(MemorySaver):
    name = "cuda"
    resumes_zeroed = False  # a resumed tag gets fresh physical pages, contents undefined

    def __init__(self, weights_backup: BackupMode, backup_dir: Path) -> None:
        super().__init__()
        from torch_memory_saver import torch_memory_saver

        self._tms = torch_memory_saver
        self._weights_backup = weights_backup
        self.backup_folder = BackupFolder(backup_dir)
        self._disk_dir: Path | None = None  # where torch_memory_saver spills, once told
        self._has_backup_storage = False  # the retained pinned buffer, or the disk files, exist
        self._pools: dict[MemoryTag, set[tuple[int, int]]] = {tag: set() for tag in MemoryTag}
        if weights_backup is BackupMode.CPU:
            self._tms.retain_cpu_backup = True
            if not self._tms.retain_cpu_backup:
                raise RuntimeError("torch_memory_saver did not keep the CPU backup policy; it needs version 0.0.10")
        elif weights_backup is BackupMode.DISK:
            try:  # before the first region, where torch_memory_saver has always been told
                self._point_disk_backup()
            except BackupUnavailable as exc:
                log.warning("%s; a release with the backup will try again", exc)

    @contextlib.contextmanager
    def region(self, tag: MemoryTag) -> Iterator[None]:
        is_weights = tag is MemoryTag.WEIGHTS
        with self._counted(tag), self._tms.region(
                tag=tag.value, enable_cpu_backup=is_weights and self._weights_backup is BackupMode.CPU,
                enable_disk_backup=is_weights and self._weights_backup is BackupMode.DISK):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
        """Capture ``graph`` so that its private memory pool belongs to the ``cuda_graph`` tag."""
        with self._counted(MemoryTag.CUDA_GRAPH), self._tms.cuda_graph(graph, pool=pool, stream=stream,
                                                                        tag=MemoryTag.CUDA_GRAPH.value):
            yield

    @contextlib.contextmanager
    def _counted(self, tag: MemoryTag) -> Iterator[None]:
        """Learn which memory pools hold ``tag``: those of the segments the block made."""
        before = {segment["address"] for segment in torch.cuda.memory_snapshot()}
        try:
            yield
        finally:
            for segment in torch.cuda.memory_snapshot():
                pool = tuple(segment["segment_pool_id"])
                if segment["address"] not in before and pool != _DEFAULT_POOL:
                    self._pools[tag].add(pool)

    def tag_bytes(self, tag: MemoryTag) -> int:
        pools = self._pools[tag]
        if not pools:
            return 0
        return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                   if tuple(segment["segment_pool_id"]) in pools)

    def register(self, tag: MemoryTag, tensors: Any) -> None:
        """Nothing to track: the tag's pools hold its memory."""

    def add_bytes(self, tag: MemoryTag, num_bytes: int) -> None:
        """Counted already: a pool made inside the tag's region is one of the tag's pools."""

    def check_release(self, tag: MemoryTag, *, keep_contents: bool) -> None:
        """Raise ``BackupUnavailable`` if the weights backup (made on every release of a backed-up region,
        whatever ``keep_contents`` says) has no room; the first release allocates it, later ones reuse it."""
        if tag is not MemoryTag.WEIGHTS or self._weights_backup is BackupMode.NONE:
            return
        needed = 0 if self._has_backup_storage else self.tag_bytes(tag)
        if self._weights_backup is BackupMode.CPU:
            if needed:
                check_host_room(needed, "the pinned CPU backup of the weights")
            return
        if self._point_disk_backup():  # the first folder, or the old one went away
            needed = self.tag_bytes(tag)
        check_dir_room(self.backup_folder.claim(), needed)
        if not self._has_backup_storage:
            check_host_room(DISK_STAGING_BYTES, "the disk backup's pinned staging buffer")

    def _point_disk_backup(self) -> bool:
        """Tell torch_memory_saver this engine's own folder (``memory/backup_folder.py``); True when that is a
        new folder, holding no backup yet. :class:`BackupUnavailable` when none can be made."""
        folder = self.backup_folder.claim()
        if folder == self._disk_dir:
            return False
        self._tms.set_disk_backup_dir(str(folder))
        self._disk_dir = folder
        return True

    def release(self, tag: MemoryTag, *, keep_contents: bool) -> int:
        # keep_contents is decided when the region was made (the backup mode); nothing to do per call.
        torch.cuda.synchronize()  # no kernel may still touch the pages
        self._tms.pause(tag.value)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the allocator's cached blocks outside every tag go back too
        torch.cuda.ipc_collect()
        if tag is MemoryTag.WEIGHTS and self._weights_backup is not BackupMode.NONE:
            self._has_backup_storage = True
        return self.tag_bytes(tag)

    def resume(self, tag: MemoryTag) -> int:
        self._tms.resume(tag.value)
        torch.cuda.synchronize()
        return self.tag_bytes(tag)

    def has_backup(self, tag: MemoryTag) -> bool:
        return tag is MemoryTag.WEIGHTS and self._weights_backup is not BackupMode.NONE

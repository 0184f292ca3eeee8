"""The memory saver and the free-memory reader a configuration asks for."""

from __future__ import annotations

import uuid
from pathlib import Path

from node_engine.config import EngineConfig
from node_engine.memory.info import CudaMemoryInfo, FileOverrideMemoryInfo, HostMemoryInfo, MemoryInfo
from node_engine.memory.saver import CpuSaver, DisabledSaver, MemorySaver


def make_saver(config: EngineConfig) -> MemorySaver:
    """``off`` without ``--enable-memory-saver``; torch_memory_saver's regions on CUDA (imported only there);
    the CPU backend otherwise."""
    if not config.enable_memory_saver:
        return DisabledSaver()
    backup_dir = config.backup_dir or Path(f"/tmp/handoff-backup-{uuid.uuid4().hex[:8]}")
    if config.device == "cuda":
        from node_engine.memory.saver_cuda import CudaSaver

        return CudaSaver(config.weights_backup, backup_dir)
    return CpuSaver(backup_dir)


def make_memory_info(config: EngineConfig) -> MemoryInfo:
    info: MemoryInfo = CudaMemoryInfo() if config.device == "cuda" else HostMemoryInfo()
    if config.free_memory_override_file is not None:
        info = FileOverrideMemoryInfo(config.free_memory_override_file, info)
    return info

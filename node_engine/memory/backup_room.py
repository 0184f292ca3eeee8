"""Room for a weights backup, checked before a release touches anything.

A backup that fails part way is worse than one refused up front: the CPU
backend would answer 507 after unpacking the weights, and torch_memory_saver
ends the process (``exit(1)``) when its disk write fails or ``cudaMallocHost``
finds no memory. So a release first checks that the backup has somewhere to go
and raises :class:`BackupUnavailable` (an ``OSError``: the engine answers 507
``backup_failed``, nothing released) if not. What is not checkable stays a race
with other processes (docs/memory.md, "What can still end the process").
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from node_engine.memory.cgroup_memory import CGROUP_ROOT, host_memory

BACKUP_MARGIN_BYTES = 64 * 1024 * 1024  # file system metadata, a page cache, another process's small allocations


class BackupUnavailable(OSError):
    """The weights backup cannot be written now; nothing was released."""


def check_dir_room(folder: Path, num_bytes: int) -> None:
    """``folder`` (created if missing) takes a new file and has ``num_bytes`` free beyond the margin."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".handoff-probe-"):
            pass
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise BackupUnavailable(f"the backup directory {folder} cannot take a file: {exc}") from exc
    if free < num_bytes + BACKUP_MARGIN_BYTES:
        raise BackupUnavailable(f"the backup directory {folder} has {free} bytes free; the backup needs {num_bytes} "
                                f"and a margin of {BACKUP_MARGIN_BYTES}")


def check_host_room(num_bytes: int, what: str, *, cgroup_root: Path = CGROUP_ROOT) -> None:
    """The host has ``num_bytes`` of available memory beyond the margin, for ``what``, within the container's
    memory limit: past it the cgroup's OOM killer ends the engine (a pod's restart, resident again)."""
    memory = host_memory(cgroup_root)
    available = memory.available_bytes
    if available < num_bytes + BACKUP_MARGIN_BYTES:
        where = "within the container's memory limit" if memory.limited_by_cgroup else "on the host"
        raise BackupUnavailable(f"{what} needs {num_bytes} bytes of host memory; {available} are available "
                                f"{where} (margin {BACKUP_MARGIN_BYTES})")

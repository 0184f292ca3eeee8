"""Host memory as a container sees it: the host's ``MemAvailable`` capped by the memory cgroup's limit.

``psutil.virtual_memory()`` reads ``/proc/meminfo``, the host's: an engine in a Kubernetes container with a 64 GiB
limit on a 2 TiB host is told of terabytes free, and what it allocates past its limit (a pinned CPU backup of the
weights) gets the process killed by the cgroup's OOM killer instead of refused. A container sees its own cgroup at
``/sys/fs/cgroup`` (cgroup v2 with a cgroup namespace, Kubernetes' default, or v1's per-controller mount).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_NO_LIMIT = 2**62  # v1 writes "no limit" as LONG_MAX rounded down to a page


@dataclass(frozen=True)
class HostMemory:
    """What this process may still allocate on the host, and the most it may hold."""

    available_bytes: int
    total_bytes: int
    limited_by_cgroup: bool


def host_memory(cgroup_root: Path = CGROUP_ROOT) -> HostMemory:
    """The host's available and total memory, each capped by the memory cgroup's limit when there is one."""
    vm = psutil.virtual_memory()
    available, total = int(vm.available), int(vm.total)
    cgroup = cgroup_room(cgroup_root)
    if cgroup is None:
        return HostMemory(available, total, limited_by_cgroup=False)
    room, limit = cgroup
    return HostMemory(min(available, room), min(total, limit), limited_by_cgroup=room < available)


def cgroup_room(root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """``(room, limit)`` of the memory cgroup at ``root``: the bytes its processes may add before the limit, and the
    limit; None when it has none or its files cannot be read. Page cache counts as room, as in the host's
    ``MemAvailable`` (the kernel reclaims it before the cgroup's OOM killer acts: the model files read at load are
    cached there, often the weights' size), except shared memory (``/dev/shm``, tmpfs), which only swap could free."""
    if (root / "memory.max").is_file():
        files = (root / "memory.max", root / "memory.current", root / "memory.stat", ("file", "shmem"))
    else:
        v1 = root / "memory"
        files = (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes", v1 / "memory.stat",
                 ("total_cache", "total_shmem"))
    limit_file, usage_file, stat_file, (cache_key, shmem_key) = files
    try:
        limit_text = limit_file.read_text().strip()
        if limit_text == "max" or int(limit_text) >= _V1_NO_LIMIT:
            return None
        limit, usage = int(limit_text), int(usage_file.read_text().strip())
        stat = stat_file.read_text()
        reclaimable = max(0, _stat_value(stat, cache_key) - _stat_value(stat, shmem_key))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("cannot read the memory cgroup at %s (%s): using the host's memory figures", root, exc)
        return None
    return max(0, limit - max(0, usage - reclaimable)), limit


def _stat_value(text: str, key: str) -> int:
    """One counter of a ``memory.stat`` file (0 when it has none)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0

"""Host memory as a container sees it: the host's ``MemAvailable`` capped by the memory cgroup's limit.

``psutil.virtual_memory()`` reads ``/proc/meminfo``, the host's: an engine in a Kubernetes container with a 64 GiB
limit on a 2 TiB host is told of terabytes free, and what it allocates past its limit (a pinned CPU backup of the
weights) gets the process killed by the cgroup's OOM killer instead of refused. A container sees its own cgroup at
``/sys/fs/cgroup`` (cgroup v2 with a cgroup namespace, Kubernetes' default, or v1's per-controller mount); a
process without a namespace of its own (a systemd unit, a container sharing the host's) finds its cgroup below
that by ``/proc/self/cgroup``, and every ancestor's limit visible there counts too (the tightest one binds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_NO_LIMIT = 2**62  # v1 writes "no limit" as LONG_MAX rounded down to a page


@dataclass(frozen=True)
class HostMemory:
    """What this process may still allocate on the host, and the most it may hold."""

    available_bytes: int
    total_bytes: int
    limited_by_cgroup: bool


def host_memory(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> HostMemory:
    """The host's available and total memory, each capped by the memory cgroups' limits when there are some."""
    vm = psutil.virtual_memory()
    available, total = int(vm.available), int(vm.total)
    cgroup = cgroup_room(cgroup_root, proc_cgroup)
    if cgroup is None:
        return HostMemory(available, total, limited_by_cgroup=False)
    room, limit = cgroup
    return HostMemory(min(available, room), min(total, limit), limited_by_cgroup=room < available)


def cgroup_room(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, int] | None:
    """``(room, limit)`` of the memory cgroups that bound this process under ``root``: the bytes its processes may
    add before the tightest limit, and that limit; None when none has a limit or their files cannot be read.
    Page cache counts as room, as in the host's ``MemAvailable`` (the kernel reclaims it before the cgroup's OOM
    killer acts: the model files read at load are cached there, often the weights' size), except shared memory
    (``/dev/shm``, tmpfs), which only swap could free."""
    rooms = [room for directory, is_v1 in memory_cgroups(root, proc_cgroup)
             if (room := _room_in(directory, is_v1)) is not None]
    if not rooms:
        return None
    return min(room for room, _ in rooms), min(limit for _, limit in rooms)


def memory_cgroups(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> list[tuple[Path, bool]]:
    """The memory cgroup directories above this process under ``root``, its own first (from ``/proc/self/cgroup``:
    without a cgroup namespace, as a systemd unit or a container run with the host's, ``root`` is the host's and
    the process's own cgroup is below it), each with whether it is cgroup v1."""
    is_v1 = not ((root / "memory.max").is_file() or (root / "cgroup.controllers").is_file())
    base = root / "memory" if is_v1 else root
    own = _own_cgroup(proc_cgroup, is_v1)
    found = []
    for depth in range(len(own.parts), -1, -1):
        directory = base.joinpath(*own.parts[:depth])
        if directory.is_dir():
            found.append((directory, is_v1))
    return found or [(base, is_v1)]


def _own_cgroup(proc_cgroup: Path, is_v1: bool) -> Path:
    """This process's cgroup path, relative (``.`` when it cannot be read or lies outside this view: the root alone
    is used)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return Path(".")
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if (is_v1 and "memory" in controllers.split(",")) or (not is_v1 and controllers == ""):
            parts = [part for part in path.split("/") if part and part != "."]
            # ".." leads: the cgroup is outside this namespace's view (the kernel writes it relative to the
            # namespace's root), so no folder under ``root`` is it; dropping the ".." would name another
            if ".." in parts or not parts:
                return Path(".")
            return Path(*parts)
    return Path(".")


def _room_in(directory: Path, is_v1: bool) -> tuple[int, int] | None:
    """``(room, limit)`` of one memory cgroup directory; None without a limit or when it cannot be read."""
    if is_v1:
        files = (directory / "memory.limit_in_bytes", directory / "memory.usage_in_bytes",
                 directory / "memory.stat", ("total_cache", "total_shmem"))
    else:
        files = (directory / "memory.max", directory / "memory.current", directory / "memory.stat",
                 ("file", "shmem"))
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
        log.warning("cannot read the memory cgroup at %s (%s): using the host's memory figures", directory, exc)
        return None
    return max(0, limit - max(0, usage - reclaimable)), limit


def _stat_value(text: str, key: str) -> int:
    """One counter of a ``memory.stat`` file (0 when it has none)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0

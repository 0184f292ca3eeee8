"""Host memory for a weights backup within a container's memory limit (cgroup v2 and v1 file layouts).

The cgroup trees are folders with the kernel's file names and formats; the host's own figures are real.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from node_engine.memory.backup_room import BACKUP_MARGIN_BYTES, BackupUnavailable, check_host_room
from node_engine.memory.cgroup_memory import cgroup_room, host_memory

GiB = 2**30


def v2_tree(root: Path, limit: str, usage: int, cache: int = 0, shmem: int = 0) -> Path:
    """cgroup v2's files: ``file`` counts the page cache, tmpfs and shared memory included (in ``shmem``)."""
    write_files(root, {"memory.max": limit, "memory.current": usage,
                       "memory.stat": f"anon {usage - cache}\nfile {cache}\nshmem {shmem}\nfile_mapped 0\n"
                                      f"active_file {cache - shmem}\ninactive_file 0"})
    return root


def v1_tree(root: Path, limit: int, usage: int, cache: int = 0, shmem: int = 0) -> Path:
    """cgroup v1's files, in the memory controller's folder of the mount at ``root``."""
    v1_cgroup(root / "memory", limit, usage, cache, shmem)
    return root


def v1_cgroup(directory: Path, limit: int, usage: int, cache: int = 0, shmem: int = 0) -> None:
    """One v1 memory cgroup's files: the hierarchy's counters are the ``total_`` ones."""
    write_files(directory, {"memory.limit_in_bytes": limit, "memory.usage_in_bytes": usage,
                            "memory.stat": f"cache 0\nshmem 0\ntotal_cache {cache}\ntotal_shmem {shmem}\n"
                                           f"total_active_file {cache - shmem}"})


def write_files(directory: Path, contents: dict[str, object]) -> None:
    """Each file of a cgroup's folder, one line as the kernel writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in contents.items():
        (directory / name).write_text(f"{value}\n")


def test_a_pinned_backup_past_the_containers_limit_is_refused_though_the_host_has_room(tmp_path: Path) -> None:
    """A 64 GiB container on a large host: the host's MemAvailable said yes, and the pinned backup got the engine
    killed by the cgroup's OOM killer (the pod restarted resident, during training)."""
    host_available = psutil.virtual_memory().available
    need = 2 * GiB
    root = v2_tree(tmp_path / "v2", str(need), usage=need // 2)
    assert host_available > need + BACKUP_MARGIN_BYTES, "the host itself has room for this test's backup"
    with pytest.raises(BackupUnavailable, match="within the container's memory limit"):
        check_host_room(need, "the pinned CPU backup of the weights", cgroup_root=root)
    roomy = v2_tree(tmp_path / "roomy", str(64 * GiB), usage=need // 2)
    check_host_room(min(need, host_available // 4), "the pinned CPU backup of the weights", cgroup_root=roomy)


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_the_room_is_the_limit_less_what_cannot_be_reclaimed(tmp_path: Path, layout: str) -> None:
    """The page cache (the model files read at load: often the weights' size) is room, as in the host's
    MemAvailable; shared memory in /dev/shm is not (nothing but swap frees it)."""
    limit, usage, cache, shmem = 8 * GiB, 7 * GiB, 3 * GiB, 1 * GiB
    root = (v2_tree(tmp_path, str(limit), usage, cache, shmem) if layout == "v2"
            else v1_tree(tmp_path, limit, usage, cache, shmem))
    assert cgroup_room(root) == (3 * GiB, limit)  # used: 7 GiB less the 2 GiB of page cache that is not shmem
    memory = host_memory(root)
    assert memory.available_bytes == min(3 * GiB, psutil.virtual_memory().available)
    assert memory.total_bytes == min(limit, psutil.virtual_memory().total)


@pytest.mark.parametrize("build", [
    lambda root: v2_tree(root, "max", GiB),                          # v2 without a limit
    lambda root: v1_tree(root, 9223372036854771712, GiB),            # v1 without a limit
    lambda root: root,                                               # no cgroup files at all
])
def test_without_a_limit_the_hosts_figures_stand(tmp_path: Path, build) -> None:
    root = build(tmp_path)
    assert cgroup_room(root) is None
    memory = host_memory(root)
    assert not memory.limited_by_cgroup and memory.total_bytes == psutil.virtual_memory().total


def test_an_unreadable_cgroup_falls_back_to_the_host_with_a_warning(tmp_path: Path, caplog) -> None:
    root = v2_tree(tmp_path, "not-a-number", GiB)
    assert cgroup_room(root) is None
    assert "cannot read the memory cgroup" in caplog.text


def test_this_machines_own_cgroup_reads_without_error() -> None:
    room = cgroup_room()
    if room is not None:
        assert 0 <= room[0] <= room[1]
    assert host_memory().available_bytes <= psutil.virtual_memory().available


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_without_a_cgroup_namespace_the_processs_own_cgroup_and_its_ancestors_bind(tmp_path: Path,
                                                                                     layout: str) -> None:
    """A process without a cgroup namespace of its own (a systemd unit, a container sharing the host's: this
    very machine runs its jobs in ``memory:/process_api/<id>``) sees the host's root at ``/sys/fs/cgroup``, which
    has no limit: its own cgroup's limit, and a pod's above it, were never read (found by review), so a backup
    past them was an OOM kill. The cgroup is found by ``/proc/self/cgroup`` and the tightest limit on the way
    up binds."""
    proc = tmp_path / "cgroup"
    if layout == "v2":
        root = tmp_path / "v2"
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpu memory pids\n")  # the host's root: no memory.max
        v2_tree(root / "kubepods" / "pod1", str(6 * GiB), 3 * GiB)
        v2_tree(root / "kubepods" / "pod1" / "engine", "max", 2 * GiB)
        proc.write_text("0::/kubepods/pod1/engine\n")
    else:
        root = v1_tree(tmp_path / "v1", 9223372036854771712, 0)  # the host's root: no limit
        v1_cgroup(root / "memory" / "process_api", 8 * GiB, 5 * GiB)
        v1_cgroup(root / "memory" / "process_api" / "job", 4 * GiB, 3 * GiB)
        proc.write_text("9:name=systemd:/\n4:memory:/process_api/job\n0::/\n")
    room, limit = cgroup_room(root, proc)
    if layout == "v2":
        assert (room, limit) == (3 * GiB, 6 * GiB)  # the pod's limit binds: the engine's own has none
    else:
        assert (room, limit) == (1 * GiB, 4 * GiB)  # the job's own limit is the tightest
    assert host_memory(root, proc).available_bytes <= room


def test_a_cgroup_outside_the_namespaces_view_is_not_taken_for_one_inside_it(tmp_path: Path) -> None:
    """A process whose cgroup lies outside its cgroup namespace's root reads ``0::/../engine`` (the kernel writes
    the path relative to that root). The ``..`` was dropped, so ``/sys/fs/cgroup/engine``, another cgroup
    inside the view, was read as the process's own and its limit bound the process (found by review); now such
    a path is not looked for under the root, and the root alone counts, as when the file cannot be read."""
    root = v2_tree(tmp_path / "v2", str(8 * GiB), 2 * GiB)  # the namespace's root: a container's limit
    v2_tree(root / "engine", str(1 * GiB), 512 * 2**20)  # a cgroup of the same name inside the view
    proc = tmp_path / "cgroup"
    proc.write_text("0::/../engine\n")
    assert cgroup_room(root, proc) == (6 * GiB, 8 * GiB)
    proc.write_text("0::/engine/../engine\n")  # never written by the kernel; not resolved either
    assert cgroup_room(root, proc) == (6 * GiB, 8 * GiB)

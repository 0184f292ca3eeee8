"""The CUDA memory-saver backend against a recording stand-in of torch_memory_saver 0.0.10 (issue 18).

No GPU here: ``tests/support/fake_tms`` is imported as ``torch_memory_saver`` and the ``torch.cuda`` calls the
backend makes are patched to record into the same log, so the order of both can be checked. What these tests
cannot see (the pages really unmapped, the backup really copied) is for ``tests/gpu``.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import psutil
import pytest
import torch

from node_engine.memory.backup_room import BACKUP_MARGIN_BYTES, BackupUnavailable
from node_engine.memory.info import DeviceMemory
from node_engine.memory.manager import MemoryManager, NotEnoughMemory
from node_engine.memory.tags import ALL_TAGS, BackupMode, MemoryTag
from tests.support.procs import REPO_ROOT

FAKE_TMS = REPO_ROOT / "tests" / "support" / "fake_tms"
MiB = 2**20


class FakeCuda:
    """``torch.cuda`` as the backend uses it: calls recorded; the allocator's segments made as a test says."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.segments: list[dict[str, Any]] = []

    def allocate(self, num_bytes: int, pool: tuple[int, int]) -> dict[str, Any]:
        segment = {"address": 0x7F0000000000 + 2**32 * len(self.segments), "total_size": num_bytes,
                   "segment_pool_id": pool}
        self.segments.append(segment)
        return segment

    def free(self, segment: dict[str, Any]) -> None:
        self.segments.remove(segment)

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "empty_cache", "ipc_collect"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, _name=name: self.calls.append((_name,)))
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a: [dict(s) for s in self.segments])
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: sum(s["total_size"] for s in self.segments))


@pytest.fixture
def tms(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(FAKE_TMS))
    monkeypatch.delitem(sys.modules, "torch_memory_saver", raising=False)
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP", raising=False)
    module = importlib.import_module("torch_memory_saver")
    assert Path(module.__file__).is_relative_to(FAKE_TMS)
    module.torch_memory_saver.reset()
    yield module
    sys.modules.pop("torch_memory_saver", None)


@pytest.fixture
def cuda(tms: ModuleType, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(tms.calls)
    fake.patch(monkeypatch)
    return fake


def build(backup: BackupMode, backup_dir: Path, cuda: FakeCuda, sizes: dict[MemoryTag, int] | None = None):
    """A CudaSaver whose four tags were filled as the runner fills them (``sizes`` bytes reserved in each)."""
    from node_engine.memory.saver_cuda import CudaSaver

    saver = CudaSaver(backup, backup_dir)
    sizes = sizes or {tag: (n + 1) * MiB for n, tag in enumerate(ALL_TAGS)}
    for n, tag in enumerate((MemoryTag.WEIGHTS, MemoryTag.WORKSPACE, MemoryTag.KV_CACHE)):
        with saver.region(tag):
            cuda.allocate(sizes[tag], pool=(n + 1, 0))  # torch_memory_saver's pool of the tag
    with saver.cuda_graph(object(), None, None):
        cuda.allocate(sizes[MemoryTag.CUDA_GRAPH], pool=(0, 9))  # the graphs' private pool
    cuda.calls.clear()
    return saver


@pytest.mark.parametrize("backup", list(BackupMode))
def test_one_region_per_tag_and_only_the_weights_backed_up(backup: BackupMode, tmp_path: Path, tms, cuda) -> None:
    build(backup, tmp_path / "backup", cuda)
    settings = tms.torch_memory_saver.region_settings
    assert set(settings) == {tag.value for tag in ALL_TAGS}
    assert settings["weights"] == {(backup is BackupMode.CPU, backup is BackupMode.DISK)}
    for tag in ("kv_cache", "workspace", "cuda_graph"):
        assert settings[tag] == {(False, False)}


def test_the_graph_pool_is_captured_into_the_cuda_graph_tag(tmp_path: Path, tms, cuda) -> None:
    from node_engine.memory.saver_cuda import CudaSaver

    saver = CudaSaver(BackupMode.NONE, tmp_path)
    graph, pool, stream = object(), object(), object()
    with saver.cuda_graph(graph, pool, stream):
        cuda.allocate(3 * MiB, pool=(0, 1))
    assert ("cuda_graph", "cuda_graph", False) in tms.calls
    assert saver.tag_bytes(MemoryTag.CUDA_GRAPH) == 3 * MiB


def test_tag_bytes_are_the_segments_of_the_tags_pools(tmp_path: Path, tms, cuda) -> None:
    sizes = {MemoryTag.WEIGHTS: 40 * MiB, MemoryTag.KV_CACHE: 100 * MiB, MemoryTag.WORKSPACE: 2 * MiB,
             MemoryTag.CUDA_GRAPH: 6 * MiB}
    saver = build(BackupMode.CPU, tmp_path, cuda, sizes)
    assert {tag: saver.tag_bytes(tag) for tag in ALL_TAGS} == sizes
    saver.register(MemoryTag.WEIGHTS, [torch.zeros(1000)])  # tensors add nothing: the pools hold them
    saver.add_bytes(MemoryTag.WORKSPACE, 5 * MiB)
    assert {tag: saver.tag_bytes(tag) for tag in ALL_TAGS} == sizes
    # The KV sizer probes with a small pool, frees it, then allocates the real one: counted as it is now.
    with saver.region(MemoryTag.KV_CACHE):
        probe = cuda.allocate(8 * MiB, pool=(3, 0))
        cuda.allocate(1 * MiB, pool=(0, 0))  # torch's own pool (a lazily made workspace): never a tag's
    cuda.free(probe)
    with saver.region(MemoryTag.KV_CACHE):
        cuda.allocate(300 * MiB, pool=(3, 0))
    assert saver.tag_bytes(MemoryTag.KV_CACHE) == 400 * MiB
    with saver.region(MemoryTag.WORKSPACE):  # a private pool made inside the region (the vision reservation)
        cuda.allocate(5 * MiB, pool=(0, 4))
    assert saver.tag_bytes(MemoryTag.WORKSPACE) == 7 * MiB


def test_release_synchronizes_pauses_synchronizes_and_empties_the_caches(tmp_path: Path, tms, cuda) -> None:
    saver = build(BackupMode.NONE, tmp_path, cuda)
    assert saver.release(MemoryTag.KV_CACHE, keep_contents=False) == saver.tag_bytes(MemoryTag.KV_CACHE)
    assert tms.calls == [("synchronize",), ("pause", "kv_cache"), ("synchronize",), ("empty_cache",),
                         ("ipc_collect",)]
    tms.calls.clear()
    saver.resume(MemoryTag.KV_CACHE)
    assert tms.calls == [("resume", "kv_cache"), ("synchronize",)]
    assert saver.resumes_zeroed is False  # fresh pages: the runner zeroes the KV pool itself


def test_the_cpu_backup_is_kept_across_cycles(tmp_path: Path, tms, cuda) -> None:
    build(BackupMode.CPU, tmp_path, cuda)
    assert tms.torch_memory_saver.retain_cpu_backup is True
    tms.torch_memory_saver.reset()
    build(BackupMode.DISK, tmp_path / "disk", cuda)
    folder = Path(tms.torch_memory_saver.disk_backup_dir)  # the engine's own folder in the backup directory
    assert folder.parent == tmp_path / "disk" and folder.name.startswith("engine-") and folder.stat().st_mode & 0o777 == 0o700
    assert tms.torch_memory_saver.retain_cpu_backup is False  # no CPU backup, nothing to keep


def manager(saver, free_bytes: int, headroom: int = 0) -> MemoryManager:
    class Info:
        def read(self) -> DeviceMemory:
            return DeviceMemory("cuda", free_bytes, 80 * 2**30)

    return MemoryManager(saver, Info(), BackupMode.CPU, step_headroom_bytes=headroom)


def test_no_host_memory_for_the_first_cpu_backup_refuses_the_release_first(tmp_path: Path, tms, cuda,
                                                                           monkeypatch) -> None:
    saver = build(BackupMode.CPU, tmp_path, cuda)
    weights = saver.tag_bytes(MemoryTag.WEIGHTS)
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=weights))
    memory = manager(saver, 2**40)
    with pytest.raises(BackupUnavailable, match="pinned CPU backup"):
        memory.release(None, stage_to_cpu=None)
    assert not any(call[0] == "pause" for call in tms.calls)  # refused before anything was released
    assert memory.released_tags() == []
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=weights + BACKUP_MARGIN_BYTES))
    memory.release([MemoryTag.WEIGHTS], stage_to_cpu=None)
    memory.resume(None)
    # The retained buffer exists now: a later release needs no new host memory.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=0))
    memory.release([MemoryTag.WEIGHTS], stage_to_cpu=None)


def test_a_disk_backup_needs_a_writable_directory_with_room(tmp_path: Path, tms, cuda, monkeypatch) -> None:
    backup_dir = tmp_path / "backup"
    saver = build(BackupMode.DISK, backup_dir, cuda, {tag: 512 * MiB for tag in ALL_TAGS})
    real_usage = shutil.disk_usage(tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(shutil, "disk_usage", lambda _: real_usage._replace(free=550 * MiB))
        with pytest.raises(BackupUnavailable, match="needs 536870912"):
            saver.check_release(MemoryTag.WEIGHTS, keep_contents=True)
        saver.check_release(MemoryTag.KV_CACHE, keep_contents=False)  # only the weights are backed up
    shutil.rmtree(backup_dir)
    backup_dir.write_text("the directory went away; a file took its name")
    with pytest.raises(BackupUnavailable, match="cannot take a file"):
        saver.check_release(MemoryTag.WEIGHTS, keep_contents=True)


def test_a_resume_that_makes_the_engine_serve_leaves_room_for_a_step(tmp_path: Path, tms, cuda) -> None:
    saver = build(BackupMode.CPU, tmp_path, cuda)
    total = sum(saver.tag_bytes(tag) for tag in ALL_TAGS)
    margin = 16 * MiB  # MIN_RESUME_MARGIN_BYTES: larger than 5% of these tags
    headroom = 100 * MiB
    memory = manager(saver, total + margin + headroom - 1, headroom)
    memory.release(None, stage_to_cpu=None)
    with pytest.raises(NotEnoughMemory) as refused:
        memory.resume(None)
    assert refused.value.step_headroom_bytes == headroom and refused.value.needed_bytes == total + margin + headroom
    assert memory.released_tags() == list(ALL_TAGS)  # nothing resumed
    memory.resume([MemoryTag.WEIGHTS])  # the engine does not serve after this one: no step to leave room for
    memory.info = manager(saver, total + margin + headroom, headroom).info
    memory.resume(None)
    assert memory.released_tags() == []

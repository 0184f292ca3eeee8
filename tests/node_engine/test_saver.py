"""The CPU memory-saver backend on its own: storages freed in place, restored, cycle after cycle."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from node_engine.memory.saver import CpuSaver
from node_engine.memory.tags import MemoryTag


def test_release_resume_keeps_objects_and_restores_contents(tmp_path: Path) -> None:
    saver = CpuSaver(tmp_path)
    weights = torch.randn(256, 1024)
    view = weights[10:20]
    tied = weights  # a second reference to the same storage is counted once
    original = weights.clone()
    saver.register(MemoryTag.WEIGHTS, [weights, view, tied])
    assert saver.tag_bytes(MemoryTag.WEIGHTS) == weights.nbytes
    for _ in range(3):  # a flag set on the first cycle must not break the next one
        assert saver.release(MemoryTag.WEIGHTS, keep_contents=True) == weights.nbytes
        assert weights.untyped_storage().nbytes() == 0
        assert saver.resume(MemoryTag.WEIGHTS) == weights.nbytes
        assert torch.equal(weights, original) and torch.equal(view, original[10:20])
    assert not list((saver.backup_folder.path / "weights").iterdir())  # backups are removed once restored


def test_resume_without_backup_zero_fills_and_rss_follows(tmp_path: Path) -> None:
    saver = CpuSaver(tmp_path)
    kv = torch.ones(64, 1024, 1024, dtype=torch.uint8)  # 64 MiB
    saver.register(MemoryTag.KV_CACHE, [kv])
    proc = psutil.Process()
    before = proc.memory_info().rss
    saver.release(MemoryTag.KV_CACHE, keep_contents=False)
    released = proc.memory_info().rss
    assert before - released >= 0.9 * kv.nbytes
    saver.resume(MemoryTag.KV_CACHE)
    assert proc.memory_info().rss - released >= 0.9 * kv.nbytes
    assert int(kv.sum()) == 0


def test_free_memory_override_file_falls_back_when_absent_or_not_a_number(tmp_path: Path) -> None:
    from node_engine.memory.info import FileOverrideMemoryInfo, HostMemoryInfo

    path = tmp_path / "free"
    info = FileOverrideMemoryInfo(path, HostMemoryInfo())
    real = info.read().free_bytes
    assert real > 0
    path.write_text("1234")
    assert info.read().free_bytes == 1234
    path.write_text("not a number")
    assert info.read().free_bytes > 1234


def test_free_memory_override_file_that_cannot_be_read_as_a_count_falls_back(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 (a UnicodeDecodeError), a folder in the file's place, or a negative count made
    every read of the figure fail (``/memory_occupation``, ``/get_server_info``: 500; every resume check) or
    report negative free memory; each is ignored, with a warning, as text that is not a number is."""
    from node_engine.memory.info import FileOverrideMemoryInfo, HostMemoryInfo

    path = tmp_path / "free"
    info = FileOverrideMemoryInfo(path, HostMemoryInfo())
    path.write_bytes(b"\xff\xfe12")
    assert info.read().free_bytes > 1234
    path.write_text("-5")
    assert info.read().free_bytes > 1234
    path.unlink()
    path.mkdir()
    assert info.read().free_bytes > 1234

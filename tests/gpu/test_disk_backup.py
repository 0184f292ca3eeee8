"""The disk weights backup on a real GPU (issue 18, items 3 and 8): outputs identical after a cycle, and a
backup that cannot be written is a 507 before anything is released, where torch_memory_saver would have ended
the process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest

from tests.gpu.engines import GpuEngine, require_memory_saver, started

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def node(proc_log_dir: Path) -> Iterator[tuple[GpuEngine, Path]]:
    """The engine and its backup directory."""
    require_memory_saver()
    backup_dir = proc_log_dir / "disk_backup"
    with started(proc_log_dir, "gpu_disk_backup", "--enable-memory-saver", "--weights-backup", "disk",
                 "--backup-dir", str(backup_dir)) as engine:
        yield engine, backup_dir


def test_a_backup_with_nowhere_to_go_is_507_and_the_engine_lives(node) -> None:
    engine, backup_dir = node
    expected = engine.greedy()
    # it holds only the engine's own folder (memory/backup_folder.py), empty until the first release
    shutil.rmtree(backup_dir)
    backup_dir.write_text("a file where the backup directory was")
    try:
        refused = engine.release(None, status=507)
    finally:
        backup_dir.unlink()
        backup_dir.mkdir()  # the next release makes the engine a new folder
    assert refused["error"]["type"] == "backup_failed"
    assert engine.client.get("/health").status_code == 200
    assert all(t["state"] == "resident" for t in engine.occupation()["tags"].values())
    assert engine.greedy() == expected


def test_greedy_output_is_identical_after_a_cycle_with_disk_backup(node) -> None:
    engine, backup_dir = node
    before = engine.greedy()
    for _ in range(2):
        engine.release(None)
        # torch_memory_saver's backup files, in the engine's own folder
        assert any(f.name != ".lock" for folder in backup_dir.glob("engine-*") for f in folder.iterdir())
        assert engine.resume(None)["weights_valid"] is True
        assert engine.greedy() == before

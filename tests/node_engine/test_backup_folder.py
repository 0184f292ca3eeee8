"""Each engine's weights backup lives in a private folder of its own inside ``--backup-dir`` (found by review:
engines sharing the directory read and deleted each other's files, a longer or replaced file resumed as valid
weights, a link planted there was written through, files were world-readable, a failed spill left its files)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from node_engine.config import EngineConfig
from node_engine.memory.backup_folder import LOCK_NAME, MEMORY_FILESYSTEMS, BackupFolder, filesystem_type
from node_engine.memory.backup_room import BackupUnavailable
from node_engine.memory.saver import CpuSaver
from node_engine.memory.tags import BackupMode, MemoryTag
from tests.node_engine.engine_harness import running_engine

W = MemoryTag.WEIGHTS
REPO_ROOT = Path(__file__).resolve().parents[2]


def backed_up(root: Path, *values: float) -> tuple[CpuSaver, list[torch.Tensor]]:
    saver = CpuSaver(root)
    tensors = [torch.full((1000,), v) for v in values]
    saver.register(W, tensors)
    saver.check_release(W, keep_contents=True)
    saver.release(W, keep_contents=True)
    return saver, tensors


def files(saver: CpuSaver) -> list[Path]:
    return sorted((saver.backup_folder.path / W.value).iterdir())


def test_two_savers_sharing_a_directory_each_get_their_own_weights_back(tmp_path: Path) -> None:
    first, first_tensors = backed_up(tmp_path, 1.0, 2.0)
    second, second_tensors = backed_up(tmp_path, 3.0, 4.0)
    assert first.backup_folder.path != second.backup_folder.path
    first.resume(W)
    second.resume(W)
    assert [t[0].item() for t in first_tensors] == [1.0, 2.0]
    assert [t[0].item() for t in second_tensors] == [3.0, 4.0]


async def test_engines_sharing_a_backup_directory_resume_their_own_weights(tmp_path: Path) -> None:
    """Engine A resumed engine B's weights (200, weights_valid) and deleted B's files (B's resume: 507)."""
    prompt = [256] + list(range(30, 90, 3))

    def config(seed: int) -> EngineConfig:
        return EngineConfig(model_path="builtin:tiny", seed=seed, max_total_tokens=512, enable_memory_saver=True,
                            weights_backup=BackupMode.DISK, backup_dir=tmp_path)

    async with running_engine(config(0)) as a, running_engine(config(1)) as b:
        scores = {}
        for engine in (a, b):
            scores[engine] = await engine.call(lambda e=engine: e.runner.score(prompt).clone())
        assert not torch.equal(scores[a], scores[b])
        for engine in (a, b):
            await engine.call(lambda e=engine: e.control.release(None, True))
        for engine in (a, b):
            answer = await engine.call(lambda e=engine: e.control.resume(None))
            assert answer["weights_valid"]
            assert torch.equal(await engine.call(lambda e=engine: e.runner.score(prompt).clone()), scores[engine])


def test_a_backup_file_of_another_size_is_refused_and_kept(tmp_path: Path) -> None:
    saver, tensors = backed_up(tmp_path, 5.0, 6.0)
    victim = files(saver)[1]
    whole = victim.read_bytes()
    victim.write_bytes(whole + b"14 bytes more.")
    with pytest.raises(OSError, match="expected 4000"):
        saver.resume(W)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # all or nothing: still released
    victim.write_bytes(whole)
    saver.resume(W)
    assert [t[0].item() for t in tensors] == [5.0, 6.0]


def test_the_folder_is_private_and_nothing_planted_in_it_is_written_through(tmp_path: Path) -> None:
    saver, tensors = backed_up(tmp_path, 7.0)
    folder = saver.backup_folder.path
    assert folder.parent == tmp_path and folder.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files(saver))
    saver.resume(W)
    victim = tmp_path / "victim.txt"
    victim.write_text("not the weights")
    (folder / W.value / "00000.bin").symlink_to(victim)  # where the next spill writes
    saver.check_release(W, keep_contents=True)
    saver.release(W, keep_contents=True)
    assert victim.read_text() == "not the weights"
    saver.resume(W)
    assert tensors[0][0].item() == 7.0


def test_a_spill_that_fails_part_way_leaves_no_files(tmp_path: Path) -> None:
    saver, tensors = backed_up(tmp_path, 1.0, 2.0, 3.0, 4.0)
    saver.resume(W)
    (saver.backup_folder.path / W.value / "00002.bin").mkdir()  # the third file cannot be made
    with pytest.raises(OSError):
        saver.release(W, keep_contents=True)
    assert [p.name for p in files(saver)] == ["00002.bin"]  # the two written before it are gone
    assert [t[0].item() for t in tensors] == [1.0, 2.0, 3.0, 4.0]  # still resident


def test_a_directory_that_cannot_hold_the_folder_is_refused_and_tried_again(tmp_path: Path) -> None:
    root = tmp_path / "backup"
    root.write_text("a file where the directory should be")
    folder = BackupFolder(root)
    with pytest.raises(BackupUnavailable, match="cannot take a file"):
        folder.claim()
    root.unlink()
    assert folder.claim().parent == root


CLAIMER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from node_engine.memory.backup_folder import BackupFolder
    folder = BackupFolder(Path(sys.argv[1]))
    path = folder.claim()
    if sys.argv[2] == "die":
        folder.release_lock()  # as a killed process's lock goes: the folder stays, nobody holds it
        print(path, flush=True)
        sys.stdout.close()
        import os; os._exit(0)  # no clean-up at exit
    print(path, flush=True)
    sys.stdin.read()
""")


def claimed_by_child(root: Path, how: str) -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", CLAIMER, str(root), how], cwd=REPO_ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def test_folders_of_dead_engines_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    live_child, live = claimed_by_child(tmp_path, "live")
    try:
        dead_child, dead = claimed_by_child(tmp_path, "die")
        dead_child.wait(timeout=30)
        (dead / "weights").mkdir()
        (dead / "weights" / "00000.bin").write_bytes(b"left by an engine that was killed")
        outside = tmp_path.parent / f"{tmp_path.name}-outside"
        outside.mkdir()
        (outside / LOCK_NAME).write_text("")
        (tmp_path / "engine-link").symlink_to(outside)  # never followed, never removed through
        mine = BackupFolder(tmp_path).claim()
        assert not dead.exists()
        assert live.is_dir() and mine.is_dir() and outside.is_dir()
    finally:
        live_child.communicate("", timeout=30)
    assert not live.exists()  # removed by its own engine at exit


def test_the_filesystem_of_a_path_is_that_of_its_deepest_mount(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:25 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw\n"
        "31 22 0:26 / /mnt/my\\040disk rw - xfs /dev/sdb1 rw\n"
        "32 31 0:27 / /mnt/my\\040disk/ram rw - ramfs ramfs rw\n"
        "33 22 0:28 / /dev/shm rw - ext4 /dev/sdc1 rw\n"  # mounted over /dev/shm later: it hides the tmpfs
        "garbage line\n")
    assert filesystem_type(Path("/"), mountinfo) == "ext4"
    assert filesystem_type(Path("/dev/shmx/a"), mountinfo) == "ext4"  # a prefix of a name is not a mount above it
    assert filesystem_type(Path("/mnt/my disk/backups"), mountinfo) == "xfs"
    assert filesystem_type(Path("/mnt/my disk/ram/x"), mountinfo) == "ramfs"
    assert filesystem_type(Path("/dev/shm/x"), mountinfo) == "ext4"
    assert filesystem_type(Path("/x"), tmp_path / "absent") is None


def test_a_mount_point_with_escaped_characters_is_read_as_its_path(tmp_path: Path) -> None:
    """The kernel writes a mount point's space, tab, line end and backslash as octal escapes; only ``\\040`` was
    read back (found by review), so a tmpfs mounted at a path with a tab or a backslash was never matched and
    the backup folder on it was taken for the disk below, with no warning. A name with a byte that is not UTF-8
    or a form feed (neither escaped) is read as the path is spelled too."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_bytes(
        b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        b"40 22 0:30 / /mnt/back\\134slash rw - tmpfs tmpfs rw\n"
        b"41 22 0:31 / /mnt/tab\\011ed rw - ramfs ramfs rw\n"
        b"42 22 0:32 / /mnt/caf\xe9 rw - tmpfs tmpfs rw\n"
        b"43 22 0:33 / /mnt/form\x0cfeed rw - tmpfs tmpfs rw\n")
    assert filesystem_type(Path("/mnt/back\\slash/backups"), mountinfo) == "tmpfs"
    assert filesystem_type(Path("/mnt/tab\ted/backups"), mountinfo) == "ramfs"
    assert filesystem_type(Path(os.fsdecode(b"/mnt/caf\xe9/backups")), mountinfo) == "tmpfs"
    assert filesystem_type(Path("/mnt/form\x0cfeed/backups"), mountinfo) == "tmpfs"
    assert filesystem_type(Path("/mnt/back/slash"), mountinfo) == "ext4"


@pytest.mark.skipif(filesystem_type(Path("/dev/shm")) != "tmpfs", reason="/dev/shm is not a tmpfs here")
def test_a_backup_folder_in_memory_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A backup under ``--backup-dir`` on tmpfs (``/tmp`` is one on many hosts) moved the weights into the host's
    shared memory while the release reported them freed, and nothing said so (found by review): the host got
    nothing back. The engine now warns when it claims such a folder; one on disk is not warned about."""
    on_disk = BackupFolder(tmp_path / "disk")
    in_memory = BackupFolder(Path("/dev/shm") / f"handoff-test-{tmp_path.name}")
    try:
        with caplog.at_level("WARNING", logger="node_engine.memory.backup_folder"):
            if filesystem_type(tmp_path) not in MEMORY_FILESYSTEMS:
                on_disk.claim()
                assert not caplog.records
            in_memory.claim()
        assert any("is on tmpfs, which is memory" in r.getMessage() for r in caplog.records), caplog.records
    finally:
        on_disk.remove()
        in_memory.remove()
        in_memory.root.rmdir()

"""The weights backup's own folder: one per engine process, private, and removed once its engine is gone.

Engines may share a ``--backup-dir`` (a chart value, a host path mounted into several pods). Each engine spills
into a folder of its own inside it, ``engine-XXXXXXXX`` (mode 0700), on which it holds an exclusive ``flock``
for its whole life, so:

- one engine never reads, overwrites or deletes another's backup;
- nothing planted in the backup directory is followed: the folder is new, and every file in it is created
  new (``O_EXCL | O_NOFOLLOW``, mode 0600) by :func:`create_file`;
- a folder whose engine died (its lock free) is removed by the next engine that claims a folder there, or
  that starts; an engine removes its own at exit.

The folder is claimed when the first backup needs it (:meth:`BackupFolder.claim`), not at start: a backup
directory that cannot be used is a 507 for that release, as any other room check, and a later release tries
again.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from node_engine.memory.backup_room import BackupUnavailable

log = logging.getLogger(__name__)

PREFIX = "engine-"
LOCK_NAME = ".lock"
_CLAIMING_PREFIX = ".claiming-"  # a folder being set up; never swept (its lock may not be held yet)
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})  # a backup there is held in host memory, not on disk
# the kernel writes a mount point's space, tab, line end and backslash as a backslash and three octal digits
_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


class BackupFolder:
    """This engine's folder inside ``root``, made on the first :meth:`claim` and kept for the process's life."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._path: Path | None = None
        self._lock_fd: int | None = None
        if root.is_dir():
            sweep_orphans(root)
        atexit.register(self.remove)  # nothing to do unless a folder was claimed

    @property
    def path(self) -> Path | None:
        """The folder, once claimed."""
        return self._path

    def claim(self) -> Path:
        """The folder, made (and the orphans of dead engines removed) on the first call;
        :class:`BackupUnavailable` when ``root`` cannot hold it, and the next call tries again."""
        if self._path is not None and self._path.is_dir():
            return self._path
        try:
            return self._make()
        except OSError as exc:
            raise BackupUnavailable(f"the backup directory {self.root} cannot take a file (this engine's "
                                    f"folder): {exc}") from exc

    def _make(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        sweep_orphans(self.root)
        claiming = Path(tempfile.mkdtemp(prefix=_CLAIMING_PREFIX, dir=self.root))  # mode 0700
        path = self.root / (PREFIX + claiming.name.removeprefix(_CLAIMING_PREFIX))
        lock_fd = -1
        try:
            lock_fd = os.open(claiming / LOCK_NAME,
                              os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(claiming, path)  # only now can a sweeper see it, locked
        except OSError:
            if lock_fd >= 0:
                os.close(lock_fd)
            _rmtree(claiming)
            raise
        self.release_lock()
        self._path, self._lock_fd = path, lock_fd
        kind = filesystem_type(path)
        if kind in MEMORY_FILESYSTEMS:
            log.warning("the weights backup folder %s is on %s, which is memory: a release moves the weights into "
                        "the host's shared memory and the host gets nothing back; give --backup-dir a folder on "
                        "disk", path, kind)
        return path

    def remove(self) -> None:
        """Delete the folder and its files (at exit: the backup dies with the engine)."""
        if self._path is not None:
            if self._path.is_dir() and not self._path.is_symlink():  # not whatever took its name since
                _rmtree(self._path)
            self._path = None
        self.release_lock()

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def sweep_orphans(root: Path) -> None:
    """Remove the folders in ``root`` whose engine is gone: those whose lock nobody holds."""
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        log.warning("could not list the backup directory %s: %s", root, exc)
        return
    for entry in entries:
        if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(Path(entry.path) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # no lock of ours: not a folder this code made
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its engine is alive
        finally:
            os.close(fd)
        log.info("removing the backup folder %s of an engine that is gone", entry.path)
        _rmtree(Path(entry.path))


def filesystem_type(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The type of the filesystem ``path`` is on (``tmpfs``, ``ext4``, ...): that of the deepest mount point
    above it in ``mountinfo``; None when that cannot be read."""
    try:
        resolved, lines = os.path.realpath(path), os.fsdecode(mountinfo.read_bytes()).split("\n")
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, types = fields.split(" "), tail.split(" ")
        if len(parts) < 5 or not types[0]:
            continue
        mount = _MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), parts[4])
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # a later mount over the same point hides the earlier
            best, kind = mount, types[0]
    return kind


def create_file(path: Path) -> int:
    """A new file at ``path`` for writing (mode 0600), never through a link; what was there is removed first."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def open_exact(path: Path, num_bytes: int) -> int:
    """``path`` opened for reading, never through a link; an ``OSError`` unless it holds exactly ``num_bytes``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    size = os.fstat(fd).st_size
    if size != num_bytes:
        os.close(fd)
        raise OSError(f"backup {path} is {size} bytes, expected {num_bytes}")
    return fd


def _rmtree(path: Path) -> None:
    """Remove ``path`` with everything in it, warning about what cannot be removed rather than stopping."""

    def warn(function: object, failed: str, exc: object) -> None:
        log.warning("could not remove %s from the backup directory: %s", failed, exc)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=warn)
    else:
        shutil.rmtree(path, onerror=warn)

"""Reading checkpoint files so that no file can hold the process that reads them.

A checkpoint path comes from a request, so its files are treated as hostile:

- Only regular files are read. A file is opened with ``O_NONBLOCK`` (a FIFO's
  open then returns at once instead of waiting for a writer) and checked with
  ``fstat`` on the open descriptor (no race between the check and the open);
  FIFOs, devices, sockets and directories are a :class:`CheckpointError`.
- Every system call is one that releases the GIL (``os.open``, ``os.fstat``,
  ``os.pread``, ``os.scandir``): a read stalled on a hung network mount blocks
  only its own thread. Callers run the reading on a thread with a deadline
  (:mod:`handoff.bounded_thread`).
- Sizes are bounded: small files (``config.json``, the shard index) by
  ``MAX_SMALL_FILE_BYTES``, a folder by ``MAX_SHARDS`` safetensors files (and
  their headers together: :func:`~handoff.checkpoint.safetensors_header.read_folder_headers`).
- A path that is too long, missing or unreadable is a :class:`CheckpointError`
  naming it, never an uncaught ``OSError``.

``before_read`` (the engine's fault drill) is called before every open and
every read: a stall there waits as a hung mount would.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from handoff.checkpoint.errors import CheckpointError, ModelConfigError
from handoff.service.peer_json import PeerJSONError, loads_bounded

MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024   # config.json, the shard index
READ_CHUNK_BYTES = 16 * 1024 * 1024       # a stall check and a cancel check between chunks
MAX_SHARDS = 4096                         # safetensors files in one checkpoint
INDEX_NAME = "model.safetensors.index.json"

_OS_ERRORS = {
    errno.ENAMETOOLONG: "the path is too long (a name or the whole path exceeds the system's limit)",
    errno.ENOENT: "does not exist",
    errno.EACCES: "is not readable (permission denied)",
    errno.EPERM: "is not readable (operation not permitted)",
    errno.ENOTDIR: "has a part that is not a directory",
    errno.ELOOP: "has too many symbolic links",
    errno.EISDIR: "is a directory",
}


class ReadCancelled(Exception):
    """The caller stopped waiting for this read (its deadline passed)."""


def shown(path: Path | str) -> str:
    """A path as messages show it: a 5000-character path is cut, not echoed whole."""
    text = str(path)
    return text if len(text) <= 200 else text[:120] + f"...({len(text)} characters)"


def describe_os_error(path: Path | str, exc: OSError) -> str:
    reason = _OS_ERRORS.get(exc.errno or 0, f"cannot be read ({exc.strerror or exc})")
    return f"{shown(path)} {reason}"


def _mode_name(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


class FileReader:
    """Opens and reads checkpoint files with the rules of the module docstring."""

    def __init__(self, *, before_read: Callable[[], None] | None = None) -> None:
        self.before_read = before_read

    def _stat(self, path: Path, *, absent: tuple[int, ...]) -> os.stat_result | None:
        """``os.stat``, or None for an error whose number is in ``absent``; any other is a CheckpointError."""
        try:
            return os.stat(path)
        except ValueError as exc:  # a NUL in the path
            raise CheckpointError(f"{shown(path)!r} is not a path: {exc}") from None
        except OSError as exc:
            if exc.errno in absent:
                return None
            raise CheckpointError(describe_os_error(path, exc)) from exc

    def is_dir(self, path: Path) -> bool:
        """Whether ``path`` is a folder; a path through a file is a CheckpointError saying so."""
        info = self._stat(path, absent=(errno.ENOENT,))
        return info is not None and stat.S_ISDIR(info.st_mode)

    def exists(self, path: Path) -> bool:
        return self._stat(path, absent=(errno.ENOENT, errno.ENOTDIR)) is not None

    def open(self, path: Path) -> tuple[int, int]:
        """(descriptor, size) of a regular file; anything else is a :class:`CheckpointError`.

        What the path names is checked before it is opened (opening some devices acts: a watchdog starts, a tape
        rewinds) and again on the open descriptor (it may have been swapped in between)."""
        self._before_read()
        info = self._stat(path, absent=())
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path.name} is {_mode_name(info.st_mode)}; checkpoint files must be regular files")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except ValueError as exc:  # a NUL in the path
            raise CheckpointError(f"{shown(path)!r} is not a path: {exc}") from None
        except OSError as exc:
            raise CheckpointError(describe_os_error(path, exc)) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path.name} is {_mode_name(info.st_mode)}; checkpoint files must be "
                                      "regular files")
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    @staticmethod
    def version(fd: int) -> tuple[int, ...]:
        """What tells an open file from itself rewritten, or replaced by another, since: its size and modification
        time (not its inode number: a network or FUSE mount need not keep a file's from one open to the next)."""
        info = os.fstat(fd)
        return info.st_size, info.st_mtime_ns

    def read_small(self, path: Path, limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
        fd, size = self.open(path)
        try:
            if size > limit:
                raise CheckpointError(f"{path.name} is {size} bytes; at most {limit} are read")
            return self.pread(fd, size, 0, path)
        finally:
            os.close(fd)

    def read_json(self, path: Path) -> object:
        raw = self.read_small(path)
        try:
            # in turns: a reload reads config.json and the index while the engine serves, and the byte scans of a
            # plain parse held the GIL for seconds on 16 MB
            return loads_bounded(raw, in_turns=True)
        except PeerJSONError as exc:
            raise CheckpointError(f"{path.name} is not valid JSON: {exc}") from exc

    def pread(self, fd: int, num_bytes: int, offset: int, path: Path) -> bytes:
        """Exactly ``num_bytes`` from ``offset``, in chunks; a file that ends early is a CheckpointError."""
        chunks = []
        while num_bytes:
            self._before_read()
            try:
                chunk = os.pread(fd, min(num_bytes, READ_CHUNK_BYTES), offset)
            except OSError as exc:
                raise CheckpointError(describe_os_error(path, exc)) from exc
            if not chunk:
                raise CheckpointError(f"{path.name} ended early (at byte {offset})")
            chunks.append(chunk)
            num_bytes -= len(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    def _before_read(self) -> None:
        if self.before_read is not None:
            self.before_read()

    # -- a folder's shards -----------------------------------------------------------
    def shard_files(self, folder: Path) -> list[Path]:
        """The safetensors files of a checkpoint folder: those its index names when it has one, else every
        ``*.safetensors`` file in it; at most ``MAX_SHARDS``, none outside the folder."""
        if not self.is_dir(folder):
            raise ModelConfigError(f"model folder {shown(folder)} does not exist or is not a folder")
        index = folder / INDEX_NAME
        if self.exists(index):
            return self._indexed_shards(folder, index)
        names = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.endswith(".safetensors") and not entry.name.startswith("."):
                        names.append(entry.name)
                        if len(names) > MAX_SHARDS:
                            raise CheckpointError(f"{shown(folder)} holds more than {MAX_SHARDS} safetensors files")
        except OSError as exc:
            raise CheckpointError(describe_os_error(folder, exc)) from exc
        if not names:
            raise ModelConfigError(f"no *.safetensors file in {shown(folder)}")
        return [folder / name for name in sorted(names)]

    def _indexed_shards(self, folder: Path, index: Path) -> list[Path]:
        value = self.read_json(index)
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                for name in weight_map.values()):
            raise ModelConfigError(f"{index.name} is not a valid safetensors index (a weight_map of file names "
                                   "in the folder)")
        names = sorted(set(weight_map.values()))
        if len(names) > MAX_SHARDS:
            raise CheckpointError(f"{index.name} names {len(names)} shard files, more than {MAX_SHARDS}")
        files = [folder / name for name in names]
        missing = [f.name for f in files if not self.exists(f)]
        if missing:
            raise ModelConfigError(f"{index.name} names shard files that are missing: {', '.join(missing[:10])}")
        return files

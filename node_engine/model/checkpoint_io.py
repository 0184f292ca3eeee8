"""Reading checkpoint files so that no file can hold the engine.

A checkpoint path comes from a request, so its files are treated as hostile:

- Only regular files are read. A file is opened with ``O_NONBLOCK`` (a FIFO's
  open then returns at once instead of waiting for a writer) and checked with
  ``fstat`` on the open descriptor (no race between the check and the open);
  FIFOs, devices, sockets and directories are a :class:`CheckpointError`.
- Every system call is one that releases the GIL (``os.open``, ``os.fstat``,
  ``os.pread``, ``os.preadv``): a read stalled on a hung network mount blocks
  only its own thread, never the event loop (``/health`` keeps answering) or the
  engine thread. ``safetensors.safe_open`` is not used here: its open and its
  reads hold the GIL.
- The safetensors header is parsed here, bounded (``MAX_HEADER_BYTES``), and
  every tensor's byte range is checked against its shape, dtype and the file's size.
- A path that is too long, missing or unreadable is a :class:`CheckpointError`
  naming it (a 400 for a reload), never an uncaught ``OSError``.

The fault drill (``--fault-drill-file``, :class:`~node_engine.failures.FaultDrill`)
fires at ``read`` before each read: a ``stall`` there waits as a hung mount
would, which is how the bounded reload is tested on real processes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_engine.failures import FaultDrill
from node_engine.model.arch import ModelConfigError

MAX_HEADER_BYTES = 100 * 1024 * 1024      # safetensors' own limit
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024   # config.json, the shard index
READ_CHUNK_BYTES = 16 * 1024 * 1024       # a stall check and a cancel check between chunks

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

_OS_ERRORS = {
    errno.ENAMETOOLONG: "the path is too long (a name or the whole path exceeds the system's limit)",
    errno.ENOENT: "does not exist",
    errno.EACCES: "is not readable (permission denied)",
    errno.EPERM: "is not readable (operation not permitted)",
    errno.ENOTDIR: "has a part that is not a directory",
    errno.ELOOP: "has too many symbolic links",
    errno.EISDIR: "is a directory",
}


class CheckpointError(ModelConfigError):
    """A checkpoint file that cannot be read as one: the message names the file and why."""


class ReadCancelled(Exception):
    """The caller stopped waiting for this read (its deadline passed)."""


def describe_os_error(path: Path | str, exc: OSError) -> str:
    reason = _OS_ERRORS.get(exc.errno or 0, f"cannot be read ({exc.strerror or exc})")
    shown = str(path)
    if len(shown) > 200:
        shown = shown[:120] + f"...({len(shown)} characters)"
    return f"{shown} {reason}"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes are and what they are."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0   # absolute byte offset in ``file``
    num_bytes: int = 0


def _mode_name(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


class CheckpointReader:
    """Opens and reads checkpoint files with the rules of the module docstring."""

    def __init__(self, *, drill: FaultDrill | None = None) -> None:
        self.drill = drill

    # -- files -------------------------------------------------------------------
    def is_dir(self, path: Path) -> bool:
        try:
            return stat.S_ISDIR(os.stat(path).st_mode)
        except ValueError as exc:  # a NUL in the path
            raise CheckpointError(f"{str(path)[:200]!r} is not a path: {exc}") from None
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise CheckpointError(describe_os_error(path, exc)) from exc

    def exists(self, path: Path) -> bool:
        try:
            os.stat(path)
        except ValueError as exc:  # a NUL in the path
            raise CheckpointError(f"{str(path)[:200]!r} is not a path: {exc}") from None
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise CheckpointError(describe_os_error(path, exc)) from exc
        return True

    def open(self, path: Path) -> tuple[int, int]:
        """(descriptor, size) of a regular file; anything else is a :class:`CheckpointError`."""
        self._drill()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
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

    def read_small(self, path: Path, limit: int = MAX_SMALL_FILE_BYTES) -> bytes:
        fd, size = self.open(path)
        try:
            if size > limit:
                raise CheckpointError(f"{path.name} is {size} bytes; at most {limit} are read")
            return self._pread(fd, size, 0, path)
        finally:
            os.close(fd)

    def read_json(self, path: Path) -> object:
        raw = self.read_small(path)
        try:
            return loads_bounded(raw)
        except PeerJSONError as exc:
            raise CheckpointError(f"{path.name} is not valid JSON: {exc}") from exc

    # -- safetensors -------------------------------------------------------------
    def header(self, path: Path) -> dict[str, TensorEntry]:
        """Every tensor of one safetensors file, from its header alone (checked against the file's size)."""
        fd, size = self.open(path)
        try:
            if size < 8:
                raise CheckpointError(f"{path.name} is too short to be a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", self._pread(fd, 8, 0, path))
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path.name}: header length {header_len} does not fit the file ({size} "
                                      f"bytes) or the {MAX_HEADER_BYTES}-byte limit")
            raw = self._pread(fd, header_len, 8, path)
        finally:
            os.close(fd)
        try:
            header = loads_bounded(raw)
        except PeerJSONError as exc:
            raise CheckpointError(f"{path.name}: the safetensors header is not valid JSON ({exc})") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{path.name}: the safetensors header is not a JSON object")
        return _entries(path, header, data_start=8 + header_len, data_end=size)

    def iter_tensors(self, entries: dict[str, TensorEntry], keys: list[str],
                     cancel: threading.Event | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Read ``keys`` one tensor at a time (file by file, in offset order), each into a fresh CPU tensor."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(entries[key].file, []).append(key)
        for path, file_keys in by_file.items():
            fd, size = self.open(path)
            try:
                for key in sorted(file_keys, key=lambda k: entries[k].offset):
                    entry = entries[key]
                    if entry.offset + entry.num_bytes > size:
                        raise CheckpointError(f"{path.name} shrank while it was read (tensor {key})")
                    tensor = torch.empty(entry.shape, dtype=entry.dtype)
                    self._read_into(fd, tensor, entry.offset, path, cancel)
                    yield key, tensor
            finally:
                os.close(fd)

    # -- raw reads ---------------------------------------------------------------
    def _drill(self) -> None:
        if self.drill is not None:
            self.drill.fire("read")

    def _pread(self, fd: int, num_bytes: int, offset: int, path: Path) -> bytes:
        chunks = []
        while num_bytes:
            self._drill()
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

    def _read_into(self, fd: int, tensor: torch.Tensor, offset: int, path: Path,
                   cancel: threading.Event | None) -> None:
        num_bytes = tensor.numel() * tensor.element_size()
        if num_bytes == 0:
            return
        buffer = memoryview((ctypes.c_char * num_bytes).from_address(tensor.data_ptr())).cast("B")
        done = 0
        while done < num_bytes:
            self._drill()
            if cancel is not None and cancel.is_set():
                raise ReadCancelled()
            end = min(num_bytes, done + READ_CHUNK_BYTES)
            try:
                num = os.preadv(fd, [buffer[done:end]], offset + done)
            except OSError as exc:
                raise CheckpointError(describe_os_error(path, exc)) from exc
            if num == 0:
                raise CheckpointError(f"{path.name} ended early (at byte {offset + done})")
            done += num


def _entries(path: Path, header: dict, *, data_start: int, data_end: int) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"{path.name}: header entry {key!r} is not an object")
        dtype_name = info.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise CheckpointError(f"{path.name}: tensor {key} has unsupported dtype {info.get('dtype')!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise CheckpointError(f"{path.name}: tensor {key} has a malformed shape or data_offsets")
        begin, end = offsets
        num_bytes = dtype.itemsize
        for dim in shape:
            num_bytes *= dim
        if end - begin != num_bytes or data_start + end > data_end:
            raise CheckpointError(f"{path.name}: tensor {key} ({info.get('dtype')} {shape}) does not match its "
                                  f"byte range {offsets} in a file of {data_end} bytes")
        entries[key] = TensorEntry(path, tuple(shape), dtype, data_start + begin, num_bytes)
    return entries

"""Reading checkpoint tensors so that no file can hold the engine.

The files are opened and read by :class:`handoff.checkpoint.files.FileReader`
(regular files only, GIL-free system calls, bounded sizes) and each header is
parsed by :mod:`handoff.checkpoint.safetensors_header` (the ``safetensors``
library's rules); this module adds what needs torch: each tensor's torch dtype
(the engine loads the dtypes of ``SAFETENSORS_DTYPES``) and reading a tensor's
bytes straight into a CPU tensor (``os.preadv``, in chunks, with a cancel check
between them). ``safetensors.safe_open`` is not used: its open and its reads
hold the GIL, so a read stalled on a hung mount would stop the engine.

The fault drill (``--fault-drill-file``, :class:`~node_engine.failures.FaultDrill`)
fires at ``read`` before each open and read: a ``stall`` there waits as a hung
mount would, which is how the bounded reload is tested on real processes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from handoff.checkpoint.errors import CheckpointError
from handoff.checkpoint.files import READ_CHUNK_BYTES, FileReader, ReadCancelled, describe_os_error, shown
from handoff.checkpoint.safetensors_header import HeaderEntry, read_header
from node_engine.failures import FaultDrill

__all__ = ["CheckpointError", "CheckpointReader", "ReadCancelled", "SAFETENSORS_DTYPES", "TensorEntry"]

# The safetensors dtypes the engine loads.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
BOUNCE_BYTES = 64 * 1024 * 1024  # the pinned host buffer a read onto a GPU goes through


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes are and what they are."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0   # absolute byte offset in ``file``
    num_bytes: int = 0
    version: tuple[int, ...] = ()  # the file's when its header was read: a file changed since is not read


class CheckpointReader(FileReader):
    """:class:`~handoff.checkpoint.files.FileReader` with torch dtypes and tensor reads, and the fault drill."""

    def __init__(self, *, drill: FaultDrill | None = None) -> None:
        super().__init__(before_read=None if drill is None else lambda: drill.fire("read"))
        self.drill = drill

    def header(self, path: Path) -> dict[str, TensorEntry]:
        """Every tensor of one safetensors file, from its header alone."""
        return {name: self.entry(name, entry) for name, entry in read_header(self, path).items()}

    @staticmethod
    def entry(name: str, entry: HeaderEntry) -> TensorEntry:
        """A header's tensor with its torch dtype; a dtype the engine does not load is named."""
        dtype = SAFETENSORS_DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{entry.file.name}: tensor {shown(name)} has dtype {entry.dtype}, which this engine "
                                  f"does not load (it loads {', '.join(SAFETENSORS_DTYPES)})")
        return TensorEntry(entry.file, entry.shape, dtype, entry.offset, entry.num_bytes, entry.version)

    def iter_tensors(self, entries: dict[str, TensorEntry], keys: list[str],
                     cancel: threading.Event | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Read ``keys`` one tensor at a time (file by file, in offset order), each into a fresh CPU tensor."""
        def read(fd: int, entry: TensorEntry) -> torch.Tensor:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            self._read_into(fd, _bytes_of(tensor), entry, cancel)
            return tensor

        yield from self._iter(entries, keys, read)

    def iter_tensors_on(self, device: torch.device, entries: dict[str, TensorEntry], keys: list[str],
                        cancel: threading.Event | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`iter_tensors` into fresh tensors on a CUDA ``device``, through one pinned host buffer of
        ``BOUNCE_BYTES``: no host memory is faulted in per read, which is what bounds reading into fresh host
        tensors (1.4 GB/s on an H200 machine, where the page cache gives 10 GB/s and more). Copies run on a
        stream of their own, so a busy engine's kernels do not hold them up."""
        bounce = torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream(device)

        def read(fd: int, entry: TensorEntry) -> torch.Tensor:
            with torch.cuda.stream(stream):
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device=device)
                target = tensor.reshape(-1).view(torch.uint8)
                for start in range(0, entry.num_bytes, BOUNCE_BYTES):
                    size = min(BOUNCE_BYTES, entry.num_bytes - start)
                    self._read_into(fd, _bytes_of(bounce[:size]), entry, cancel, start)
                    target[start:start + size].copy_(bounce[:size])  # waits for the copy: the buffer is reused
            return tensor

        yield from self._iter(entries, keys, read)

    def _iter(self, entries: dict[str, TensorEntry], keys: list[str],
              read: Callable[[int, TensorEntry], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(entries[key].file, []).append(key)
        for path, file_keys in by_file.items():
            fd, size = self.open(path)
            try:
                for key in sorted(file_keys, key=lambda k: entries[k].offset):
                    entry = entries[key]
                    self._check_unchanged(fd, entry, path)  # the header's offsets may describe another file
                    if entry.offset + entry.num_bytes > size:
                        raise CheckpointError(f"{path.name} shrank while it was read (tensor {key})")
                    tensor = read(fd, entry)
                    self._check_unchanged(fd, entry, path)  # written to while this tensor was read
                    yield key, tensor
            finally:
                os.close(fd)

    def _check_unchanged(self, fd: int, entry: TensorEntry, path: Path) -> None:
        if entry.version and self.version(fd) != entry.version:
            raise CheckpointError(f"{path.name} changed since its header was read (rewritten or replaced while it "
                                  "was loaded)")

    def _read_into(self, fd: int, buffer: memoryview, entry: TensorEntry, cancel: threading.Event | None,
                   start: int = 0) -> None:
        """Fill ``buffer`` from ``entry``'s bytes at ``start`` on, in chunks, with a cancel check between them."""
        path, offset, done = entry.file, entry.offset + start, 0
        while done < len(buffer):
            self._before_read()
            if cancel is not None and cancel.is_set():
                raise ReadCancelled()
            end = min(len(buffer), done + READ_CHUNK_BYTES)
            try:
                num = os.preadv(fd, [buffer[done:end]], offset + done)
            except OSError as exc:
                raise CheckpointError(describe_os_error(path, exc)) from exc
            if num == 0:
                raise CheckpointError(f"{path.name} ended early (at byte {offset + done})")
            done += num


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, writable."""
    num_bytes = tensor.numel() * tensor.element_size()
    if num_bytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * num_bytes).from_address(tensor.data_ptr())).cast("B")

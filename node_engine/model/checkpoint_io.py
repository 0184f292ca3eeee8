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
from handoff.checkpoint.read_crew import ReadCrew
from handoff.checkpoint.safetensors_header import HeaderEntry, read_header
from node_engine.failures import FaultDrill

__all__ = ["CheckpointError", "CheckpointReader", "ReadCancelled", "SAFETENSORS_DTYPES", "TensorEntry"]

# The safetensors dtypes the engine loads.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
BOUNCE_BYTES = 64 * 1024 * 1024  # each of the two pinned host buffers a read onto a GPU goes through
READ_THREADS = 6  # threads filling one of them (page-cache copies run in parallel)
# Tensors back to back in a file are read onto a GPU as one run up to this size: one allocation and large reads,
# while a read stuck on hung storage holds at most this much (or one larger tensor) of device memory.
MAX_RUN_BYTES = 256 * 1024 * 1024


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

        for (key,), tensor in self._iter(entries, keys, read, max_run_bytes=0):
            yield key, tensor

    def iter_tensors_on(self, device: torch.device, entries: dict[str, TensorEntry], keys: list[str],
                        cancel: threading.Event | None = None, *,
                        num_threads: int = READ_THREADS) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`iter_tensors` onto a CUDA ``device``. Tensors that lie back to back in a file are read as one
        run (up to ``MAX_RUN_BYTES``) into one device buffer and yielded as views of it, each once its copies are
        done. Reads go through two pinned host buffers of ``BOUNCE_BYTES``: no host memory is faulted
        in per read, which is what bounds reading into fresh host tensors (1.4 GB/s on an H200 machine, where the
        page cache gives 10 GB/s and more). Each buffer is filled by ``num_threads`` readers
        (:class:`~handoff.checkpoint.read_crew.ReadCrew`) while the other one's copy runs; copies run on a stream
        of their own, so a busy engine's kernels do not hold them up."""
        bounces = [torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy, done once it is passed
        stream = torch.cuda.Stream(device)
        turn = 0

        def read(fd: int, run: TensorEntry) -> torch.Tensor:
            nonlocal turn
            with torch.cuda.stream(stream):
                target = torch.empty(run.num_bytes, dtype=torch.uint8, device=device)
                for start in range(0, run.num_bytes, BOUNCE_BYTES):
                    size, bounce = min(BOUNCE_BYTES, run.num_bytes - start), bounces[turn]
                    if copied[turn] is not None:
                        copied[turn].synchronize()  # the buffer's last copy has left it
                    view = _bytes_of(bounce[:size])
                    crew.fill(size, lambda a, b: self._read_into(fd, view[a:b], run, cancel, start + a))
                    target[start:start + size].copy_(bounce[:size], non_blocking=True)
                    copied[turn] = torch.cuda.Event()
                    copied[turn].record(stream)
                    turn ^= 1
            return target

        with ReadCrew(num_threads) as crew:
            last: tuple[list[str], torch.Tensor, torch.cuda.Event | None] | None = None
            for run_keys, run_bytes in self._iter(entries, keys, read, max_run_bytes=MAX_RUN_BYTES):
                if last is not None:
                    yield from _views_when_copied(entries, *last)
                last = run_keys, run_bytes, copied[turn ^ 1]  # the event of this run's last copy
            if last is not None:
                yield from _views_when_copied(entries, *last)

    def _iter(self, entries: dict[str, TensorEntry], keys: list[str], read: Callable[[int, TensorEntry], torch.Tensor],
              *, max_run_bytes: int) -> Iterator[tuple[list[str], torch.Tensor]]:
        """``read`` each run of ``keys`` (:func:`_runs`; file by file, in offset order): a tensor alone as its
        entry, several as one ``uint8`` entry of their bytes. The file is checked unchanged around each read."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(entries[key].file, []).append(key)
        for path, file_keys in by_file.items():
            fd, size = self.open(path)
            try:
                for run_keys in _runs(entries, sorted(file_keys, key=lambda k: entries[k].offset), max_run_bytes):
                    entry = entries[run_keys[0]] if len(run_keys) == 1 else _run_entry(entries, run_keys)
                    self._check_unchanged(fd, entry, path)  # the header's offsets may describe another file
                    if entry.offset + entry.num_bytes > size:
                        raise CheckpointError(f"{path.name} shrank while it was read (tensor {run_keys[-1]})")
                    tensor = read(fd, entry)
                    self._check_unchanged(fd, entry, path)  # written to while this tensor was read
                    yield run_keys, tensor
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


def _runs(entries: dict[str, TensorEntry], keys: list[str], max_run_bytes: int) -> Iterator[list[str]]:
    """``keys`` (in offset order) as runs: a tensor that starts where the last one ended joins its run while the
    run stays within ``max_run_bytes`` (0: every tensor alone; a tensor larger than that is a run of its own)."""
    run: list[str] = []
    for key in keys:
        entry, last = entries[key], entries[run[-1]] if run else None
        if last is not None and (entry.offset != last.offset + last.num_bytes
                                 or entry.offset + entry.num_bytes - entries[run[0]].offset > max_run_bytes):
            yield run
            run = []
        run.append(key)
    if run:
        yield run


def _run_entry(entries: dict[str, TensorEntry], run_keys: list[str]) -> TensorEntry:
    first, last = entries[run_keys[0]], entries[run_keys[-1]]
    num_bytes = last.offset + last.num_bytes - first.offset
    return TensorEntry(first.file, (num_bytes,), torch.uint8, first.offset, num_bytes, first.version)


def _views_when_copied(entries: dict[str, TensorEntry], run_keys: list[str], run_bytes: torch.Tensor,
                       copy_done: torch.cuda.Event | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a run, as a view of the run's bytes, once the run's copies are done."""
    if copy_done is not None:
        copy_done.synchronize()
    base = entries[run_keys[0]].offset
    for key in run_keys:
        entry = entries[key]
        start = entry.offset - base
        raw = run_bytes[start:start + entry.num_bytes]
        if start % entry.dtype.itemsize:
            raw = raw.clone()  # a view as another dtype must start on a multiple of its element size
        yield key, raw.view(entry.dtype).view(entry.shape)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, writable."""
    num_bytes = tensor.numel() * tensor.element_size()
    if num_bytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * num_bytes).from_address(tensor.data_ptr())).cast("B")

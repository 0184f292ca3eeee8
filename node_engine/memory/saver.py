"""Memory-saver backends: make a tag's memory go away and come back, same tensors.

The interface the engine sees:

- ``region(tag)``: allocations made inside belong to ``tag`` (needed by the
  CUDA backend, whose allocator hook routes them into a pausable pool).
- ``register(tag, tensors)``: tell the backend which tensors a tag holds, so it
  can free them (CPU) and report their bytes (all backends).
- ``check_release(tag, keep_contents)``: raise (an ``OSError``) if releasing
  ``tag`` now would fail part way, before anything is released (the room for
  a backup).
- ``release(tag, keep_contents)`` / ``resume(tag)``: give the tag's memory
  back / take it again at the same shapes, without touching the objects that
  hold the tensors. Contents survive only with ``keep_contents`` (a backup);
  without, a resumed tag reads zeros only where ``resumes_zeroed`` says so.
- ``cuda_graph(graph, pool, stream)``: capture a CUDA graph whose private pool
  belongs to ``cuda_graph``.

Backends: ``off`` (no ``--enable-memory-saver``: release and resume refuse),
``cpu`` (our own; frees tensor storages and returns the pages to the OS), and
``cuda`` (torch_memory_saver in preload hook mode, in ``saver_cuda``).
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from node_engine.memory.backup_folder import BackupFolder, create_file, open_exact
from node_engine.memory.backup_room import check_dir_room
from node_engine.memory.host_heap import trim_host_heap
from node_engine.memory.tags import MemoryTag

log = logging.getLogger(__name__)


class MemorySaverDisabled(RuntimeError):
    """Release/resume asked of an engine started without ``--enable-memory-saver``."""


class MemorySaver(abc.ABC):
    name: str
    is_enabled = True  # False: release and resume refuse (nothing is touched)
    resumes_zeroed = False  # a tag resumed without a backup reads zeros (else its contents are undefined)

    def __init__(self) -> None:
        self._bytes: dict[MemoryTag, int] = {tag: 0 for tag in MemoryTag}

    @contextlib.contextmanager
    def region(self, tag: MemoryTag) -> Iterator[None]:
        yield

    def register(self, tag: MemoryTag, tensors: Iterable[torch.Tensor]) -> None:
        """Record ``tensors`` as belonging to ``tag`` (shared storages are counted once)."""
        for storage in _unique_storages(tensors):
            self._bytes[tag] += storage.nbytes()
            self._track(tag, storage)

    def add_bytes(self, tag: MemoryTag, num_bytes: int) -> None:
        """Account memory made inside ``tag``'s region that no registered tensor holds (a private pool)."""
        self._bytes[tag] += num_bytes

    @contextlib.contextmanager
    def cuda_graph(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
        """Capture ``graph`` (CUDA); what its private pool grows by is the ``cuda_graph`` tag's."""
        with self._counted(MemoryTag.CUDA_GRAPH), torch.cuda.graph(graph, pool=pool, stream=stream):
            yield

    @contextlib.contextmanager
    def _counted(self, tag: MemoryTag) -> Iterator[None]:
        """CUDA: count what torch reserves while the block runs as ``tag``'s (the engine thread allocates
        nothing else meanwhile)."""
        before = torch.cuda.memory_reserved()
        try:
            yield
        finally:
            self._bytes[tag] += max(0, torch.cuda.memory_reserved() - before)

    def tag_bytes(self, tag: MemoryTag) -> int:
        """What the tag holds on its device: what a release gives back."""
        return self._bytes[tag]

    def _track(self, tag: MemoryTag, storage: torch.UntypedStorage) -> None:
        pass

    def check_release(self, tag: MemoryTag, *, keep_contents: bool) -> None:
        """Raise an ``OSError`` if releasing ``tag`` now would fail part way; nothing is touched."""

    @abc.abstractmethod
    def release(self, tag: MemoryTag, *, keep_contents: bool) -> int:
        """Free the tag's memory; returns bytes freed."""

    @abc.abstractmethod
    def resume(self, tag: MemoryTag) -> int:
        """Allocate the tag's memory again (restoring contents if they were kept); returns bytes. An
        ``OSError``: nothing was resumed, the kept contents are still kept."""

    def discard_backup(self, tag: MemoryTag) -> None:
        """Forget the contents kept for ``tag``: its next resume gives it memory only (zeros)."""


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: set[int] = set()
    storages = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            storages.append(storage)
    return storages


class DisabledSaver(MemorySaver):
    name = "off"
    is_enabled = False

    def release(self, tag: MemoryTag, *, keep_contents: bool) -> int:
        raise MemorySaverDisabled("memory saver is off: start the engine with --enable-memory-saver")

    def resume(self, tag: MemoryTag) -> int:
        raise MemorySaverDisabled("memory saver is off: start the engine with --enable-memory-saver")


class CpuSaver(MemorySaver):
    """Frees the storages of a tag in place (``resize_(0)``) and gives the pages back to the OS.

    Tensors, views and the modules holding them stay the same objects: a
    storage resized back to its size is visible through every view of it.
    Contents are kept, when asked, by spilling each storage to a file under
    ``backup_dir`` and reading it back on resume.
    """

    name = "cpu"
    resumes_zeroed = True  # resume touches every page it takes back, with zeros

    def __init__(self, backup_dir: Path) -> None:
        super().__init__()
        self._storages: dict[MemoryTag, list[tuple[torch.UntypedStorage, int]]] = {tag: [] for tag in MemoryTag}
        self.backup_folder = BackupFolder(backup_dir)
        self._backed_up: dict[MemoryTag, list[Path]] = {}

    def _track(self, tag: MemoryTag, storage: torch.UntypedStorage) -> None:
        if not storage.resizable():
            raise ValueError(f"a {tag.value} tensor has a storage that cannot be freed in place")
        self._storages[tag].append((storage, storage.nbytes()))

    def check_release(self, tag: MemoryTag, *, keep_contents: bool) -> None:
        if keep_contents:
            check_dir_room(self.backup_folder.claim() / tag.value, self.tag_bytes(tag))

    def release(self, tag: MemoryTag, *, keep_contents: bool) -> int:
        entries = self._storages[tag]
        if keep_contents:
            self._backed_up[tag] = self._spill(tag, entries)
        num_bytes = 0
        for storage, nbytes in entries:
            storage.resize_(0)
            num_bytes += nbytes
        trim_host_heap()
        return num_bytes

    def resume(self, tag: MemoryTag) -> int:
        """All or nothing: if any storage cannot be given its memory back or its backup cannot be read, every
        storage is freed again and the backup stays, files and all, for another try (an ``OSError``)."""
        entries = self._storages[tag]
        paths = self._backed_up.get(tag)
        num_bytes = 0
        try:
            for storage, nbytes in entries:
                storage.resize_(nbytes)
                if paths is None:
                    # Touch the pages: a resume takes the memory back for real, as it does on a GPU.
                    torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
                num_bytes += nbytes
            if paths is not None:
                for (storage, nbytes), path in zip(entries, paths, strict=True):
                    with open(open_exact(path, nbytes), "rb") as f:
                        num_read = f.readinto(memoryview(_as_bytes(storage)))
                    if num_read != nbytes:
                        raise OSError(f"backup {path} gave {num_read} bytes, expected {nbytes}")
        except BaseException:
            for storage, _ in entries:
                storage.resize_(0)
            trim_host_heap()
            raise
        self.discard_backup(tag)
        return num_bytes

    def discard_backup(self, tag: MemoryTag) -> None:
        self._remove_files(self._backed_up.pop(tag, []))

    @staticmethod
    def _remove_files(paths: list[Path]) -> None:
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # nothing reads it again: a file left over is only disk space
                log.warning("could not remove the backup file %s: %s", path, exc)

    def has_backup(self, tag: MemoryTag) -> bool:
        return tag in self._backed_up

    def _spill(self, tag: MemoryTag, entries: list[tuple[torch.UntypedStorage, int]]) -> list[Path]:
        """One file per storage in this engine's own folder; on any error the files written so far go too."""
        folder = self.backup_folder.claim() / tag.value
        folder.mkdir(mode=0o700, exist_ok=True)
        paths: list[Path] = []
        try:
            for n, (storage, _) in enumerate(entries):
                path = folder / f"{n:05d}.bin"
                paths.append(path)
                with open(create_file(path), "wb") as f:
                    f.write(memoryview(_as_bytes(storage)))
        except BaseException:
            self._remove_files(paths)
            raise
        return paths


def _as_bytes(storage: torch.UntypedStorage) -> ctypes.Array:
    """A writable view of a storage's bytes, without a copy.

    Not ``.numpy()``: exporting to numpy marks the storage non-resizable for good,
    and the next release could not free it.
    """
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())

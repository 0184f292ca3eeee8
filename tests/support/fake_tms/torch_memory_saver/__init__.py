"""A stand-in for torch_memory_saver 0.0.10 on machines without CUDA: the same API, recording every call.

Put ``tests/support/fake_tms`` first on ``sys.path`` (or ``PYTHONPATH``) and
``import torch_memory_saver`` gets this. Nothing is allocated or unmapped; the
fake keeps the state the real library keeps (which tag is paused, the region
settings of each tag) and refuses what the real one would end the process for
(pausing a paused tag, resuming an active one, both backups on one region), by
raising :class:`FakeExit`. ``calls`` is the ordered log; a test may append its
own entries to it (``torch.cuda.synchronize`` patched to record, for example) to
check the order of both.

``configure_subprocess`` puts ``$FAKE_TMS_PRELOAD`` (a test's own library) in
``LD_PRELOAD``, as the real one puts its preload library there.

Read against the real source: ``torch_memory_saver/entrypoint.py`` and
``csrc/core.cpp`` of 0.0.10.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

calls: list[tuple[Any, ...]] = []


class FakeExit(RuntimeError):
    """What the real library does with ``exit(1)``."""


class TorchMemorySaver:
    def __init__(self) -> None:
        self.active_tags: set[str] = set()      # tags with allocations, mapped
        self.paused_tags: set[str] = set()
        self.region_settings: dict[str, set[tuple[bool, bool]]] = {}  # tag -> {(cpu_backup, disk_backup)}
        self.disk_backup_dir: Optional[str] = None
        self._retain_cpu_backup = os.environ.get("TMS_RETAIN_CPU_BACKUP", "") in ("1", "true", "True")
        self.memory_margin = 0

    def reset(self) -> None:
        self.__init__()
        calls.clear()

    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        if enable_cpu_backup and enable_disk_backup:
            raise FakeExit("cpu_backup and disk_backup are mutually exclusive")
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        calls.append(("region", tag, enable_cpu_backup, enable_disk_backup))
        self.region_settings.setdefault(tag, set()).add((enable_cpu_backup, enable_disk_backup))
        self.active_tags.add(tag)
        yield
        calls.append(("region_exit", tag))

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "global",
                   tag: str = "default", enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        calls.append(("cuda_graph", tag, enable_cpu_backup))
        self.region_settings.setdefault(tag, set()).add((enable_cpu_backup, False))
        self.active_tags.add(tag)
        yield
        calls.append(("cuda_graph_exit", tag))

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        calls.append(("disable",))
        yield

    def pause(self, tag: Optional[str] = None) -> None:
        calls.append(("pause", tag))
        for t in self._matching(tag):
            if t in self.paused_tags:
                raise FakeExit(f"Cannot pause allocation that is not active. tag={t}")
            self.paused_tags.add(t)

    def resume(self, tag: Optional[str] = None) -> None:
        calls.append(("resume", tag))
        for t in self._matching(tag):
            if t not in self.paused_tags:
                raise FakeExit(f"Cannot resume allocation that is not paused. tag={t}")
            self.paused_tags.discard(t)

    def _matching(self, tag: Optional[str]) -> list[str]:
        return sorted(self.active_tags if tag is None else {tag} & self.active_tags)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def memory_margin_bytes(self) -> int:
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        calls.append(("memory_margin_bytes", value))
        self.memory_margin = value

    @property
    def retain_cpu_backup(self) -> bool:
        return self._retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        calls.append(("retain_cpu_backup", value))
        self._retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> None:
        return None

    def set_disk_backup_dir(self, path: str) -> None:
        calls.append(("set_disk_backup_dir", path))
        os.makedirs(path, exist_ok=True)
        self.disk_backup_dir = path


torch_memory_saver = TorchMemorySaver()


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """``LD_PRELOAD`` gets ``$FAKE_TMS_PRELOAD`` in front, for the block (as the real one does with its library)."""
    lib_path = os.environ.get("FAKE_TMS_PRELOAD", "/nonexistent/torch_memory_saver_hook_mode_preload_fake.so")
    old = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{lib_path}:{old}" if old else lib_path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old
